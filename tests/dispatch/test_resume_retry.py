"""Issue #38, third case: a resume whose launch failed before any trainer ran counts as no resume. Before, the
first POST /train/<id>/resume got 503 launch_failed (retryable), and its retry with the same Idempotency-Key got
422 not_resumable (`already_resumed`): the failed launch's row counted as the resume. Now the retry is accepted
and runs, on either backend (locally the supervisor did not start; under Slurm sbatch failed), and auto_resume
tries again too, a bounded number of times."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from lora_worker.dispatch.auto_resume import AUTO_RESUME_LAUNCH_TRIES
from lora_worker.errors import LaunchFailed
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.states import FailureClass, JobState
from tests.helpers import Host, job_rows
from tests.helpers.ledger import migrated_ledger
from tests.helpers.states import cut_off_by_a_reboot, interrupted
from tests.slurm.fakes import close_worker, slurm_worker


class Launcher(list):
    """The local supervisor launcher of a test: records each launch, and fails the ones armed to (a full /tmp, a
    fork refused: the supervisor never starts)."""

    failing = 0

    def __call__(self, job_id: int, settings: object) -> None:
        self.append(job_id)
        if self.failing:
            self.failing -= 1
            raise LaunchFailed("The supervisor did not start in 15s.", job_id=job_id)


@dataclass
class Worker:
    client: object
    db: Database
    host: Host
    fail_launches: object  # (n) -> None: the next n launches fail before any trainer runs


@pytest.fixture(params=["local", "slurm"])
def worker(request, host: Host) -> Iterator[Worker]:
    if request.param == "local":
        from lora_worker import create_app

        migrated_ledger(host.settings.database_path)
        launcher = Launcher()
        app = create_app(host.settings, launch=launcher)
        db = Database.open(host.settings.database_path)

        def arm(n: int) -> None:
            launcher.failing = n
        yield Worker(app.test_client(), db, host, arm)
        app.extensions["lora_worker"].db.dispose()
        db.dispose()
    else:
        slurm, app = slurm_worker(host)

        def down(n: int) -> None:  # sbatch cannot reach slurmctld; back up after the launch that failed
            real = slurm.scheduler.submit

            def submit(options, script, args=()):
                nonlocal n
                if n:
                    n -= 1
                    slurm.scheduler.down = True
                    try:
                        return real(options, script, args)
                    finally:
                        slurm.scheduler.down = False
                return real(options, script, args)
            slurm.scheduler.submit = submit  # type: ignore[method-assign]
        yield Worker(slurm.client, slurm.db, host, down)
        close_worker(slurm, app)


def submitted(worker: Worker) -> int:
    answer = worker.client.post("/train", json=worker.host.payload())
    assert answer.status_code == 202, answer.get_json()
    return answer.get_json()["worker_job_id"]


def test_a_retry_of_a_resume_whose_launch_failed_is_accepted_and_runs(worker):
    original = submitted(worker)
    interrupted(worker.db, worker.host.settings, original, FailureClass.SUPERVISOR_LOST)
    worker.fail_launches(1)
    first = worker.client.post(f"/train/{original}/resume", headers={"Idempotency-Key": "resume-7"})
    body = first.get_json()
    assert first.status_code == 503 and body["error"] == "launch_failed" and body["retryable"] is True, body
    failed = repo.get_job(worker.db, body["details"]["job_id"])
    assert (failed.status, failed.failure_class, failed.resumed_from) == ("failed", "launch_error", original)
    retry = worker.client.post(f"/train/{original}/resume", headers={"Idempotency-Key": "resume-7"})
    assert retry.status_code == 202, retry.get_json()  # 422 not_resumable (already_resumed) before
    resumed = repo.get_job(worker.db, retry.get_json()["worker_job_id"])
    assert (resumed.resumed_from, resumed.attempt, resumed.resume_step) == (original, 2, 4)
    assert resumed.status in (JobState.QUEUED.value, JobState.RUNNING.value) and resumed.id != failed.id
    again = worker.client.post(f"/train/{original}/resume", headers={"Idempotency-Key": "resume-7"})
    assert again.status_code == 200 and again.get_json()["worker_job_id"] == resumed.id  # the key is the run's now
    verdict = worker.client.get(f"/train/{original}/resume").get_json()
    assert [r["code"] for r in verdict["reasons"]] == ["already_resumed"]  # the resume that runs counts


def test_the_resume_that_never_ran_is_not_resumed_itself_its_original_is(worker):
    original = submitted(worker)
    interrupted(worker.db, worker.host.settings, original, FailureClass.SUPERVISOR_LOST)
    worker.fail_launches(1)
    failed = worker.client.post(f"/train/{original}/resume").get_json()["details"]["job_id"]
    answer = worker.client.post(f"/train/{failed}/resume")
    body = answer.get_json()
    assert answer.status_code == 422 and [r["code"] for r in body["details"]["reasons"]] == ["resume_never_ran"]
    assert f"resume job {original} instead" in body["message"]
    assert worker.client.get(f"/train/{original}/resume").get_json()["resumable"] is True


# -- auto_resume ---------------------------------------------------------------------------------------------


@pytest.fixture
def local(migrated, host) -> Iterator[tuple]:
    from lora_worker import create_app

    launcher = Launcher()
    app = create_app(migrated.with_overrides(auto_resume=True), launch=launcher)
    yield app, launcher
    app.extensions["lora_worker"].db.dispose()


def notes(db, job_id: int) -> list[str]:
    return [e.reason or "" for e in repo.job_events(db, job_id) if "auto_resume" in (e.reason or "")]


def test_an_auto_resume_whose_launch_failed_is_tried_again_at_the_next_reconcile(local, host, db):
    app, launcher = local
    original = cut_off_by_a_reboot(app.test_client(), host, db)
    launcher.failing = 1
    app.extensions["lora_worker"].reconcile_active()
    failed = repo.get_job(db, original + 1)
    assert (failed.failure_class, failed.resumed_from) == ("launch_error", original)
    assert notes(db, original)[-1].startswith(f"auto_resume from step 4 ({host.settings.train_root}")
    assert f"launch 1 of {AUTO_RESUME_LAUNCH_TRIES} failed" in notes(db, original)[-1]
    app.extensions["lora_worker"].reconcile_active()  # the launch counted as no resume: looked at again
    resumed = repo.get_job(db, original + 2)
    assert (resumed.resumed_from, resumed.resume_step, resumed.status) == (original, 4, "queued")
    assert notes(db, original)[-1].startswith(f"resume: auto_resume: resumed as job {resumed.id}")
    app.extensions["lora_worker"].reconcile_active()
    assert job_rows(host.settings) == 3  # and once it ran, never again


def test_an_auto_resume_that_cannot_launch_stops_trying_and_says_so(local, host, db):
    app, launcher = local
    original = cut_off_by_a_reboot(app.test_client(), host, db)
    launcher.failing = 100
    for _ in range(AUTO_RESUME_LAUNCH_TRIES + 3):
        app.extensions["lora_worker"].reconcile_active()
    assert job_rows(host.settings) == 1 + AUTO_RESUME_LAUNCH_TRIES  # a failed row per try, and no more
    last = notes(db, original)[-1]
    assert last.startswith("resume: auto_resume from step 4") and f"its {AUTO_RESUME_LAUNCH_TRIES} launches failed" \
        in last and f"POST /train/{original}/resume" in last
    launcher.failing = 0
    answer = app.test_client().post(f"/train/{original}/resume")  # a client's resume, once the cause is gone
    assert answer.status_code == 202, answer.get_json()

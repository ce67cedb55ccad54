"""Issue #38's contained boundaries: anything unexpected at a reconcile, the start-up follow-up or before a
request is contained to its job: that job is left for the next round or noted with the cause, the failure is
logged once with its traceback, and the service and every other job carry on. The service always starts."""
from __future__ import annotations

import logging
import sqlite3

import pytest

from lora_worker.dispatch import auto_resume
from lora_worker.ledger import repository as repo
from lora_worker.reconcile import reconcile
from lora_worker.host import processes
from lora_worker.states import FailureClass, JobState
from tests.helpers import job_rows
from tests.helpers.ledger import columns, running_job
from tests.helpers.states import interrupted


def tracebacks(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info is not None and text in r.getMessage()]


class Unsure:
    """A local backend whose `attended` fails for one job (a bug, a process table it cannot read), and says no
    supervisor attends the others."""

    name = "local"

    def __init__(self, broken: int) -> None:
        self.broken = broken

    def attended(self, job_id: int, settings: object) -> bool:
        if job_id == self.broken:
            raise RuntimeError("the process table could not be read")
        return False

    def abandon(self, job: object, settings: object) -> tuple[int, ...]:
        return ()


def test_a_job_whose_reconcile_fails_is_left_and_the_others_are_reconciled(db, migrated, caplog):
    broken = running_job(db, boot_id=processes.boot_id(), supervisor_pid=999_999)
    other = repo.create_job(db, {**columns(), "slot": "second", "lora_file": "/elsewhere/other.safetensors"}).id
    repo.transition(db, other, JobState.RUNNING, actor="supervisor", boot_id=processes.boot_id())
    backend = Unsure(broken)
    for _ in range(2):
        actions = reconcile(db, migrated, backend=backend)  # type: ignore[arg-type]
        assert [a.job_id for a in actions] == ([other] if _ == 0 else [])
    assert repo.get_job(db, broken).status == "running"  # left as it was, for a later round
    assert repo.get_job(db, other).failure_class == FailureClass.SUPERVISOR_LOST.value
    assert len(tracebacks(caplog, f"job {broken}: reconcile failed")) == 1  # once, however many rounds


def cut_off_by_a_reboot(client, host, db, output: str = "output") -> int:
    response = client.post("/train", json=host.payload(output_dir=str(host.dataset.parent / output)))
    job_id = response.get_json()["worker_job_id"]
    repo.transition(db, job_id, JobState.RUNNING, actor="test")
    conn = sqlite3.connect(host.settings.database_path)
    with conn:
        conn.execute("UPDATE jobs SET boot_id = 'a-boot-before-this-one' WHERE id = ?", (job_id,))
    conn.close()
    interrupted(db, host.settings, job_id, failure=None)
    return job_id


@pytest.fixture
def make_app(migrated, launches):
    from lora_worker import create_app

    made = []

    def make(**overrides):
        made.append(create_app(migrated.with_overrides(**overrides), launch=launches))
        return made[-1]
    yield make
    for app in made:
        app.extensions["lora_worker"].db.dispose()


def test_a_follow_up_that_fails_for_one_job_notes_it_and_the_service_starts(make_app, host, db, monkeypatch,
                                                                             caplog):
    first = make_app()
    client = first.test_client()
    broken = cut_off_by_a_reboot(client, host, db)
    repo.fail_job(db, broken, actor="test", failure_class=FailureClass.HOST_REBOOTED, sentence="rebooted")
    other = cut_off_by_a_reboot(client, host, db, output="output2")
    repo.fail_job(db, other, actor="test", failure_class=FailureClass.HOST_REBOOTED, sentence="rebooted")
    conn = sqlite3.connect(host.settings.database_path)
    with conn:  # the second POST's reconcile looked at the first job already: as if the reboot came after both
        conn.execute("DELETE FROM job_events WHERE reason LIKE 'resume: %'")
    conn.close()
    real = auto_resume.verdict

    def verdict(db_, settings, job, **kw):
        if job.id == broken:
            raise RecursionError("a check nobody foresaw")
        return real(db_, settings, job, **kw)
    monkeypatch.setattr(auto_resume, "verdict", verdict)
    app = make_app(auto_resume=True)  # create_app raised before: the gunicorn worker never booted
    assert app.test_client().get("/healthz").status_code == 200
    noted = [e.reason for e in repo.job_events(db, broken) if (e.reason or "").startswith("resume: ")]
    assert noted == [f"resume: not looked at: the follow-up failed (RecursionError: a check nobody foresaw); "
                     f"GET /train/{broken}/resume says whether it can be resumed"]
    assert repo.get_job(db, other + 1).resumed_from == other  # the other job is resumed all the same
    app.extensions["lora_worker"].reconcile_active()
    assert len(tracebacks(caplog, f"job {broken}: its follow-up after the reboot failed")) == 1


def test_a_start_up_reconcile_that_fails_still_starts_the_service(make_app, monkeypatch, caplog):
    import lora_worker.web.app as app_module

    def broken(*args, **kwargs):
        raise RuntimeError("a reconcile bug")
    monkeypatch.setattr(app_module, "reconcile", broken)
    app = make_app()
    assert app.test_client().get("/healthz").status_code == 200
    assert len(tracebacks(caplog, "start-up reconcile failed")) == 1


def test_a_reconcile_that_fails_before_a_request_is_logged_and_the_request_answers(make_app, host, monkeypatch,
                                                                                  caplog):
    app = make_app()
    worker = app.extensions["lora_worker"]

    def broken():
        raise RuntimeError("a reconcile bug")
    monkeypatch.setattr(worker, "reconcile_if_due", broken)
    answer = app.test_client().post("/train", json=host.payload())
    assert answer.status_code == 202, answer.get_json()  # 500 internal_error before
    assert len(tracebacks(caplog, "reconcile before train.submit failed")) == 1
    assert job_rows(host.settings) == 1

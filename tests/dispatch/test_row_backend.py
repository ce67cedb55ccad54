"""The backend is the row's: a job's device profile (batch size, precision), its environment's card, its ETA history
and its resume follow `job.backend`, never the backend the settings now give new jobs. Each promise is one test
over both backends.

Before, the profile came from the settings: after a worker was switched between backends, its older rows were
refused a resume (`fingerprint_batch_size`: the fingerprint's argv was rebuilt with the other backend's batch
size), and a Slurm row's environment named `CUDA_VISIBLE_DEVICES=<device_index>`, a card of the worker's host."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest

from lora_worker import create_app
from lora_worker.config import Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import utcnow
from lora_worker.states import FailureClass, JobState
from tests.helpers import Host, Launches
from tests.helpers.ledger import columns, migrated_ledger
from tests.helpers.states import interrupted
from tests.slurm.fakes import close_worker, slurm_worker

OTHER = {"local": "slurm", "slurm": "local"}
# What the job was cut off by on each backend: a reboot of this host, a node lost under the Slurm job.
CUT_OFF = {"local": FailureClass.HOST_REBOOTED, "slurm": FailureClass.NODE_FAIL}


@dataclass
class Worker:
    """A worker on one backend (local: its launches recorded; Slurm: a FakeScheduler), over its own ledger."""

    backend: str
    settings: Settings
    db: Database
    client: object
    host: Host

    def submit(self, **overrides: object) -> dict:
        answer = self.client.post("/train", json=self.host.payload(**overrides))  # type: ignore[attr-defined]
        assert answer.status_code == 202, answer.get_json()
        return answer.get_json()


@pytest.fixture(params=["local", "slurm"])
def worker(request: pytest.FixtureRequest, host: Host) -> Iterator[Worker]:
    if request.param == "local":
        migrated_ledger(host.settings.database_path)
        app = create_app(host.settings, launch=Launches())
        db = Database.open(host.settings.database_path)
        yield Worker("local", host.settings, db, app.test_client(), host)
        db.dispose()
        app.extensions["lora_worker"].db.dispose()
        return
    slurm, app = slurm_worker(host)
    yield Worker("slurm", slurm.settings, slurm.db, slurm.client, host)
    close_worker(slurm, app)


@pytest.fixture
def switched(worker: Worker) -> Iterator[object]:
    """A client of the same worker restarted with the other backend in its settings (its launches recorded)."""
    app = create_app(worker.settings.with_overrides(backend=OTHER[worker.backend]), launch=Launches())
    yield app.test_client()
    app.extensions["lora_worker"].db.dispose()


def batch_size(argv: list[str]) -> int:
    return int(next(a for a in argv if a.startswith("--train_batch_size=")).split("=", 1)[1])


def test_a_row_keeps_its_backends_device_profile_for_a_resume_after_the_worker_switched(worker: Worker, switched):
    """Device 1 is the 48 GB card here (batch 2 on this host); every Slurm tier's resources say batch 1."""
    job_id = worker.submit(device_index=1)["worker_job_id"]
    before = repo.get_job(worker.db, job_id)
    assert batch_size(before.argv) == {"local": 2, "slurm": 1}[worker.backend]
    interrupted(worker.db, worker.settings, job_id, CUT_OFF[worker.backend])
    body = switched.get(f"/train/{job_id}/resume").get_json()
    assert body["resumable"] is True and body["reasons"] == [], body
    assert body["from_step"] == 4


def test_a_local_rows_resume_runs_on_this_host_after_the_worker_moved_to_slurm(host: Host):
    migrated_ledger(host.settings.database_path)
    local = create_app(host.settings, launch=Launches())
    job_id = local.test_client().post("/train", json=host.payload(device_index=1)).get_json()["worker_job_id"]
    db = Database.open(host.settings.database_path)
    moved = None
    try:
        interrupted(db, host.settings, job_id)
        launches = Launches()
        moved = create_app(host.settings.with_overrides(backend="slurm"), launch=launches)
        answer = moved.test_client().post(f"/train/{job_id}/resume")
        assert answer.status_code == 202, answer.get_json()
        new = repo.get_job(db, answer.get_json()["worker_job_id"])
        original = repo.get_job(db, job_id)
        assert (new.backend, batch_size(new.argv), new.env) == ("local", 2, original.env)
        assert launches == [new.id]  # started by the local backend (here, its recorder), not sbatch
    finally:
        db.dispose()
        for app in (local, moved):
            if app is not None:
                app.extensions["lora_worker"].db.dispose()


def test_a_rows_environment_names_a_card_only_where_its_backend_places_the_job(worker: Worker):
    env = repo.get_job(worker.db, worker.submit(device_index=1)["worker_job_id"]).env
    if worker.backend == "local":
        assert env["CUDA_VISIBLE_DEVICES"] == "1"  # the card the request named, admitted on this host
    else:
        assert "CUDA_VISIBLE_DEVICES" not in env  # the node's Slurm sets the GPU it allocated


def seed(db: Database, backend: str, seconds: float, device_index: int) -> None:
    """A succeeded job of `backend` on `device_index` (fast tier, 3 images) that took `seconds`."""
    job = repo.create_job(db, columns(backend=backend, device_index=device_index, output_dir=f"/o/{backend}{seconds}",
                                      lora_file=f"/o/{backend}{seconds}/ohwx.safetensors"))
    start = utcnow() - timedelta(hours=2)
    repo.transition(db, job.id, JobState.RUNNING, actor="seed", started_at=start)
    repo.transition(db, job.id, JobState.SUCCEEDED, actor="seed", finished_at=start + timedelta(seconds=seconds))


def test_the_acceptance_estimate_comes_from_the_rows_backend_and_its_card_where_it_has_one(worker: Worker):
    for seconds in (300.0, 500.0):  # this host's card 1
        seed(worker.db, "local", seconds, device_index=1)
    seed(worker.db, "local", 9000.0, device_index=0)  # this host's other card
    seed(worker.db, "slurm", 120.0, device_index=1)
    seed(worker.db, "slurm", 180.0, device_index=0)  # under Slurm device_index picked nothing: still history
    estimate = worker.submit(device_index=1)["estimated_duration_s"]
    assert estimate == pytest.approx({"local": 400.0, "slurm": 150.0}[worker.backend], abs=0.01)

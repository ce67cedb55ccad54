"""A worker with `backend = "slurm"` whose Slurm is a FakeScheduler: real dispatch, ledger and files."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from lora_worker.config import Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import upgrade
from lora_worker.ledger.models import Job
from lora_worker.slurm.backend import SlurmBackend
from lora_worker.slurm.poller import Poller
from lora_worker.slurm.sbatch import log_path, rc_path
from tests.helpers import Host, payload
from tests.slurm.fakes import Clock, FakeScheduler


@dataclass
class SlurmWorker:
    host: Host
    settings: Settings
    db: Database
    scheduler: FakeScheduler
    clock: Clock
    client: object
    poller: Poller

    def submit(self, n: int = 0, **overrides: object) -> Job:
        body = payload(self.host.dataset, self.host.model, output_dir=str(self.host.dataset.parent / f"output{n}"),
                       **overrides)
        answer = self.client.post("/train", json=body)
        assert answer.status_code == 202, answer.get_json()
        return repo.get_job(self.db, answer.get_json()["worker_job_id"])

    def job(self, job_id: int) -> Job:
        return repo.get_job(self.db, job_id)

    def log(self, job: Job, text: str | bytes) -> None:
        data = text.encode() if isinstance(text, str) else text
        with log_path(self.settings, job.id).open("ab") as fh:
            fh.write(data)

    def rc(self, job: Job, returncode: int) -> None:
        rc_path(self.settings, job.id).write_text(f"{returncode}\n")

    def cycles(self, n: int = 1) -> None:
        for _ in range(n):
            self.poller.cycle()

    def new_poller(self) -> Poller:
        self.poller.close()
        self.poller = Poller(self.settings, self.db, self.scheduler, self.clock)
        return self.poller


def slurm_worker(host: Host, **overrides: object) -> tuple[SlurmWorker, object]:
    from lora_worker import create_app

    settings = host.settings.with_overrides(backend="slurm", max_active_jobs=3, **overrides)
    upgrade(settings.database_path)
    scheduler, clock = FakeScheduler(), Clock()
    db = Database.open(settings.database_path)
    backend = SlurmBackend(scheduler=scheduler, start_poller=lambda s: None, db=db)
    app = create_app(settings, backend=backend)
    app.config["TESTING"] = True
    return SlurmWorker(host, settings, db, scheduler, clock, app.test_client(),
                       Poller(settings, db, scheduler, clock)), app


def close_worker(worker: SlurmWorker, app: object) -> None:
    worker.poller.close()
    app.extensions["lora_worker"].db.dispose()  # type: ignore[attr-defined]
    worker.db.dispose()


@pytest.fixture
def slurm(host: Host) -> SlurmWorker:
    worker, app = slurm_worker(host)
    yield worker
    close_worker(worker, app)


def steps_bar(step: int, total: int = 400, loss: float = 0.1) -> str:
    return f"\rsteps: {100 * step // total:3d}%|#####     | {step}/{total} [00:10<00:12,  2.00it/s, avr_loss={loss}]"


__all__ = ["SlurmWorker", "steps_bar", "Path"]

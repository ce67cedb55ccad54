"""A worker with `backend = "slurm"` whose Slurm is a FakeScheduler: real dispatch, ledger and files."""
from __future__ import annotations

import pytest

from lora_worker.ledger.db import Database
from lora_worker.slurm.backend import SlurmBackend
from lora_worker.slurm.poller import Poller
from tests.helpers import Host
from tests.helpers.ledger import migrated_ledger
from tests.slurm.fakes import Clock, FakeScheduler, SlurmWorker


@pytest.fixture
def slurm(host: Host) -> SlurmWorker:
    from lora_worker import create_app

    settings = host.settings.with_overrides(backend="slurm", max_active_jobs=3)
    migrated_ledger(settings.database_path)
    scheduler, clock = FakeScheduler(), Clock()
    db = Database.open(settings.database_path)
    backend = SlurmBackend(scheduler=scheduler, start_poller=lambda s: None, db=db)
    app = create_app(settings, backend=backend)
    app.config["TESTING"] = True
    worker = SlurmWorker(host, settings, db, scheduler, clock, app.test_client(),
                         Poller(settings, db, scheduler, clock))
    yield worker
    worker.poller.close()
    app.extensions["lora_worker"].db.dispose()
    db.dispose()


"""A worker with `backend = "slurm"` whose Slurm is a FakeScheduler: real dispatch, ledger and files
(tests/slurm/fakes.py builds it)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import Host
from tests.slurm.fakes import SlurmWorker, close_worker, install_fake_slurm, slurm_worker
import os
import signal
from pathlib import Path
from lora_worker.host.locks import lock_state
from lora_worker.ledger.db import Database
from lora_worker.slurm.process import poller_lock_path
from tests.helpers import pid_alive, wait_for
from tests.helpers.ledger import migrated_ledger


@pytest.fixture
def slurm(host: Host) -> Iterator[SlurmWorker]:
    worker, app = slurm_worker(host)
    yield worker
    close_worker(worker, app)


@pytest.fixture
def worker(host: Host, tmp_path: Path):
    from lora_worker import create_app

    settings = host.settings.with_overrides(backend="slurm", slurm_bin_dir=install_fake_slurm(tmp_path / "slurm-bin"),
                                            slurm_poll_interval_s=0.2)
    migrated_ledger(settings.database_path)
    app = create_app(settings)
    db = Database.open(settings.database_path)
    yield app.test_client(), db, settings
    holder = lock_state(poller_lock_path(settings)).holder_pid
    if holder and pid_alive(holder):
        os.kill(holder, signal.SIGTERM)
        wait_for(lambda: not pid_alive(holder), what="the poller to stop")
    db.dispose()
    app.extensions["lora_worker"].db.dispose()

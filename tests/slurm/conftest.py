"""A worker with `backend = "slurm"` whose Slurm is a FakeScheduler: real dispatch, ledger and files
(tests/slurm/fakes.py builds it)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import Host
from tests.slurm.fakes import SlurmWorker, close_worker, slurm_worker


@pytest.fixture
def slurm(host: Host) -> Iterator[SlurmWorker]:
    worker, app = slurm_worker(host)
    yield worker
    close_worker(worker, app)

"""Fixtures of the web tests that run the real service: gunicorn with a token, and a job held running."""
from __future__ import annotations

import os

import pytest

from lora_worker.host.locks import hold_lock, job_lock_path
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from tests.helpers.api import write_token
from tests.helpers.ledger import columns
from tests.helpers.service import Service


@pytest.fixture
def service(migrated, host):
    token = write_token(host.root / "etc")
    svc = Service(migrated.with_overrides(api_token_file=token), host.root / "gunicorn.log").start()
    yield svc
    svc.stop()


@pytest.fixture
def running_job(migrated, db):
    """A running job whose "supervisor" (this test) holds the job lock, so reconcile leaves it alone."""
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    fd = hold_lock(job_lock_path(migrated, job.id))
    yield job.id
    os.close(fd)

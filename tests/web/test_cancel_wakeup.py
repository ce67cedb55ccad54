"""POST /train/<id>/cancel wakes the running job's supervisor, the very process its row recorded, and nothing
else: a row whose recorded identity no longer matches a live process is cancelled the same (202) and
signals nobody. Here the "supervisor" is a listener process that says "woken" on each wake-up."""
from __future__ import annotations

import os

import pytest

from lora_worker.host import processes
from lora_worker.host.locks import hold_lock, job_lock_path
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from tests.helpers.ledger import columns
from tests.helpers.wakeup import heard

pytestmark = pytest.mark.slow  # every test here starts a real process


def running_job(db, migrated, *, boot_id: str, pid: int, start_ticks: int) -> tuple[int, int]:
    """A running job recorded as supervised by that process; this test holds its job lock for it."""
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", boot_id=boot_id, supervisor_pid=pid,
                    supervisor_start_ticks=start_ticks)
    fd = hold_lock(job_lock_path(migrated, job.id))
    assert fd is not None
    return job.id, fd


def test_a_cancel_wakes_the_recorded_supervisor(api, db, migrated, listener):
    me = processes.identity_of(listener.pid)
    assert me is not None
    job_id, fd = running_job(db, migrated, boot_id=me.boot_id, pid=me.pid, start_ticks=me.start_ticks)
    try:
        response = api.post(f"/train/{job_id}/cancel")
        assert response.status_code == 202 and response.get_json()["cancel_requested_at"]
        assert heard(listener)
    finally:
        os.close(fd)


def test_a_cancel_of_a_job_whose_recorded_pid_is_now_another_process_signals_nobody(api, db, migrated, listener):
    me = processes.identity_of(listener.pid)
    assert me is not None
    job_id, fd = running_job(db, migrated, boot_id=me.boot_id, pid=me.pid, start_ticks=me.start_ticks - 1)
    try:
        response = api.post(f"/train/{job_id}/cancel")
        assert response.status_code == 202 and response.get_json()["cancel_requested_at"]
        assert not heard(listener)
    finally:
        os.close(fd)


def test_an_operators_cancel_from_the_cli_wakes_the_recorded_supervisor_too(db, migrated, listener):
    from tests.helpers.cli import jobs

    me = processes.identity_of(listener.pid)
    assert me is not None
    job_id, fd = running_job(db, migrated, boot_id=me.boot_id, pid=me.pid, start_ticks=me.start_ticks)
    try:
        assert jobs(migrated, "cancel", str(job_id)) == (0, f"job {job_id}: cancel requested\n")
        assert heard(listener)
    finally:
        os.close(fd)

"""The poller's death and restart: one poller per worker (the lock), and a restarted one resumes every active
Slurm row from the ledger and the files, as the first left them; reconcile starts it again when it is gone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lora_worker.config import settings_to_json
from lora_worker.host.locks import lock_state
from lora_worker.reconcile import reconcile
from lora_worker.run.local import SETTINGS_ENV
from lora_worker.slurm.backend import SlurmBackend
from lora_worker.slurm.process import ensure_poller, poller_lock_path, poller_running
from tests.helpers import pid_alive, wait_for
from tests.slurm.fakes import SlurmWorker, steps_bar


@pytest.fixture
def poller_pid(slurm: SlurmWorker):
    """A real detached poller for the slurm worker's settings; stopped (by its pid) after the test."""
    ensure_poller(slurm.settings)
    pid = lock_state(poller_lock_path(slurm.settings)).holder_pid
    assert pid is not None and pid_alive(pid)
    yield pid
    if pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not pid_alive(pid), what="the poller to stop")


@pytest.mark.slow
def test_a_second_poller_cannot_take_the_lock_and_exits(slurm: SlurmWorker, poller_pid: int):
    env = {**os.environ, SETTINGS_ENV: settings_to_json(slurm.settings)}
    second = subprocess.run([sys.executable, "-m", "lora_worker.slurm"], env=env, timeout=30, check=False)
    assert second.returncode == 1
    assert lock_state(poller_lock_path(slurm.settings)).holder_pid == poller_pid
    ensure_poller(slurm.settings)  # finds the one there, starts none
    assert lock_state(poller_lock_path(slurm.settings)).holder_pid == poller_pid


@pytest.mark.slow
def test_the_poller_outlives_its_starter_in_a_session_of_its_own(slurm: SlurmWorker, poller_pid: int):
    assert os.getsid(poller_pid) == poller_pid
    assert os.getsid(poller_pid) != os.getsid(0)


@pytest.mark.slow
def test_a_dead_pollers_lock_is_free_and_reconcile_starts_a_new_one_without_failing_the_job(
        slurm: SlurmWorker, poller_pid: int):
    job = slurm.submit()
    os.kill(poller_pid, signal.SIGKILL)
    wait_for(lambda: not poller_running(slurm.settings), what="the kernel to drop the lock")
    backend = SlurmBackend(scheduler=slurm.scheduler, db=slurm.db)  # the real ensure_poller
    assert reconcile(slurm.db, slurm.settings, backend=backend) == []
    assert slurm.job(job.id).status == "queued"
    new_pid = lock_state(poller_lock_path(slurm.settings)).holder_pid
    assert new_pid not in (None, poller_pid)
    os.kill(new_pid, signal.SIGTERM)
    wait_for(lambda: not pid_alive(new_pid), what="the new poller to stop")


def test_without_a_poller_a_job_slurm_still_runs_is_attended_and_one_it_forgot_is_not(slurm: SlurmWorker):
    from lora_worker.errors import LaunchFailed

    def cannot_start(settings):
        raise LaunchFailed("no poller today")

    job = slurm.submit()
    backend = SlurmBackend(scheduler=slurm.scheduler, start_poller=cannot_start, db=slurm.db)
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    assert backend.attended(job.id, slurm.settings)
    del slurm.scheduler.jobs[job.slurm_job_id]
    assert not backend.attended(job.id, slurm.settings)


def test_a_restarted_poller_resumes_every_active_row_where_the_first_left_it(slurm: SlurmWorker):
    running = slurm.submit(0)
    pending = slurm.submit(1)
    slurm.scheduler.set(running.slurm_job_id, "RUNNING")
    slurm.scheduler.set(pending.slurm_job_id, "PENDING", "Resources")
    slurm.log(running, "import network module: networks.lora\n" + steps_bar(0) + steps_bar(50, loss=0.5))
    slurm.cycles()
    assert slurm.job(running.id).step == 50
    slurm.new_poller()  # the first one died: nothing of it is left but the ledger and the files
    slurm.log(running, steps_bar(60, loss=0.4))
    slurm.cycles()
    row = slurm.job(running.id)
    assert (row.status, row.phase, row.step, row.loss) == ("running", "training", 60, 0.4)
    assert slurm.job(pending.id).queue_reason == "Resources"
    slurm.rc(running, 0)
    slurm.scheduler.set(running.slurm_job_id, "FAILED", code=0, signal=0)  # exit 0 but no save: no_output
    slurm.scheduler.set(pending.slurm_job_id, "RUNNING")
    slurm.cycles()
    assert slurm.job(running.id).failure_class == "no_output"
    assert slurm.job(pending.id).status == "running"
    run_log = (slurm.settings.log_dir / f"job-{running.id}.log").read_text()
    assert "50/400" in run_log or "60/400" in run_log  # rebuilt in full from the node's log

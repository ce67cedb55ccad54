"""The backend is the row's, not the settings': a worker switched back to local keeps attending its Slurm rows.
And the poller's heartbeat: one stuck holding its lock is noticed by `attended` and replaced."""
from __future__ import annotations

import pytest

import os
import subprocess
import sys
import time

from lora_worker.host import processes
from lora_worker.host.locks import take_lock
from lora_worker.reconcile import reconcile
from lora_worker.run.local import LocalBackend
from lora_worker.slurm.backend import SlurmBackend
from lora_worker.slurm.poller import Poller
from lora_worker.slurm.process import poller_lock_path
from tests.slurm.fakes import SlurmWorker

STUCK_S = 3600.0  # an hour without a beat: stuck by any measure (process.STUCK_AFTER_S is 5 min)


def _beat(slurm: SlurmWorker, pid: int, age_s: float) -> None:
    """The heartbeat as the poller writes it (process.py `beat`): who it is, and when it last moved."""
    me = processes.identity_of(pid)
    assert me is not None
    (slurm.settings.lock_dir / "slurm-poller.beat").write_text(
        f"{me.boot_id} {me.pid} {me.start_ticks} {time.time() - age_s:.3f}\n")


HOLD = ("import sys, time\nfrom pathlib import Path\nfrom lora_worker.host.locks import take_lock\n"
        "fd = take_lock(Path(sys.argv[1]), 2.0)\nprint('held' if fd is not None else 'not held', flush=True)\n"
        "time.sleep(120)\n")


def test_switching_the_backend_back_to_local_keeps_live_slurm_rows_attended(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.cycles()
    lock = take_lock(poller_lock_path(slurm.settings), 2.0)  # the poller runs, and beats
    assert lock is not None
    try:
        _beat(slurm, os.getpid(), 0.0)
        local = slurm.settings.with_overrides(backend="local")
        assert reconcile(slurm.db, local, backend=LocalBackend()) == []  # what the web of a local worker does
        assert slurm.job(job.id).status == "running"
    finally:
        os.close(lock)


def _stuck_poller(slurm: SlurmWorker, beat_age_s: float) -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(poller_lock_path(slurm.settings))],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    _beat(slurm, holder.pid, beat_age_s)
    return holder


def _end(holder: subprocess.Popen[str]) -> None:
    holder.kill()
    holder.wait()
    if holder.stdout is not None:
        holder.stdout.close()


@pytest.mark.slow
def test_a_poller_stuck_holding_its_lock_is_noticed_by_its_heartbeat_and_replaced(slurm: SlurmWorker):
    job = slurm.submit()
    holder = _stuck_poller(slurm, STUCK_S)
    started: list[int] = []
    backend = SlurmBackend(scheduler=slurm.scheduler, start_poller=lambda s: started.append(1), db=slurm.db)
    try:
        assert backend.attended(job.id, slurm.settings)
        assert holder.wait(5) == -9 and started == [1]  # that very process killed, a new poller started
    finally:
        _end(holder)


@pytest.mark.slow
def test_a_poller_that_beats_is_left_alone(slurm: SlurmWorker):
    job = slurm.submit()
    holder = _stuck_poller(slurm, 1.0)
    started: list[int] = []
    backend = SlurmBackend(scheduler=slurm.scheduler, start_poller=lambda s: started.append(1), db=slurm.db)
    try:
        assert backend.attended(job.id, slurm.settings)
        assert holder.poll() is None and started == []
    finally:
        _end(holder)


def test_the_poller_beats_every_cycle_and_after_each_job(slurm: SlurmWorker):
    slurm.submit(0)
    slurm.submit(1)
    beats: list[int] = []
    poller = Poller(slurm.settings, slurm.db, slurm.scheduler, slurm.clock, beat=lambda: beats.append(1))
    try:
        poller.cycle()
    finally:
        poller.close()
    assert len(beats) == 3

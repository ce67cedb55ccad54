"""`SlurmBackend`: the run seam (backends.py) when `backend = "slurm"`.

- `launch(job_id)`: writes the job's batch script, submits it (sbatch.py), records the Slurm job id in the row,
  and makes sure the poller runs; returns once all of that holds, or raises LaunchFailed. A job sbatch
  accepted but that nothing could follow is scancelled before the failure is reported, so no Slurm job runs
  for a row that says `failed`.
- `attended(job_id)`: a local supervisor's job lock, for a row from before the switch to Slurm; for a Slurm
  row, the poller's lock (a dead poller is started again here, and resumes every Slurm row), and failing that
  whether Slurm still knows the job. So reconcile never fails a job that is merely queued on the cluster.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lora_worker.config import Settings
from lora_worker.errors import LaunchFailed
from lora_worker.host.locks import is_locked, job_lock_path
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.slurm.process import ensure_poller, poller_running
from lora_worker.slurm.sbatch import submit
from lora_worker.slurm.scheduler import Scheduler, SchedulerUnavailable
from lora_worker.slurm.states import stage


@dataclass
class SlurmBackend:
    """`scheduler` and `start_poller` are Slurm's commands and `ensure_poller` unless a test gives others."""

    scheduler: Scheduler | None = None
    start_poller: Callable[[Settings], None] = ensure_poller
    db: Database | None = None
    name: str = field(default="slurm", init=False)

    def _scheduler(self, settings: Settings) -> Scheduler:
        if self.scheduler is None:
            self.scheduler = Scheduler(settings.slurm_bin_dir)
        return self.scheduler

    def _db(self, settings: Settings) -> Database:
        if self.db is None:
            self.db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s)
        return self.db

    def launch(self, job_id: int, settings: Settings) -> None:
        db, scheduler = self._db(settings), self._scheduler(settings)
        job = repo.get_job(db, job_id)
        slurm_job_id = submit(job, settings, scheduler)  # LaunchFailed with no job of its name left running
        try:
            if not repo.record_slurm_job(db, job_id, slurm_job_id):
                raise LaunchFailed(f"Job {job_id} left the queue while Slurm accepted it.", job_id=job_id)
            self.start_poller(settings)
        except BaseException:
            _cancel_quietly(scheduler, slurm_job_id)
            raise

    def attended(self, job_id: int, settings: Settings) -> bool:
        if is_locked(job_lock_path(settings, job_id)):
            return True  # a local supervisor's job
        job = repo.find_job(self._db(settings), job_id)
        if job is None or job.backend != "slurm":
            return False
        if poller_running(settings):
            return True
        try:
            self.start_poller(settings)
            return True
        except LaunchFailed:
            pass
        if job.slurm_job_id is None:
            return False  # never submitted; reconcile's launch grace covers a submission under way
        try:
            return stage(self._scheduler(settings).queue([job.slurm_job_id]).get(job.slurm_job_id)) in (
                "pending", "running")
        except SchedulerUnavailable:
            return True  # what cannot be seen is not failed: the poller, once back, settles it


def _cancel_quietly(scheduler: Scheduler, slurm_job_id: str) -> None:
    try:
        scheduler.cancel(slurm_job_id)
    except SchedulerUnavailable:
        pass

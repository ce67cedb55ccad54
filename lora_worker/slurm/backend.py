"""`SlurmBackend`: the run seam (backends.py) for a Slurm row.

- `launch(job_id)`: writes the job's batch script, submits it (sbatch.py), records the Slurm job id in the row,
  and makes sure the poller runs; returns once all of that holds, or raises LaunchFailed. A job sbatch
  accepted but that nothing could follow is scancelled before the failure is reported, so no Slurm job runs
  for a row that says `failed`.
- `attended(job_id)`: the poller's lock and a fresh heartbeat (a stuck poller is killed here and a new one
  started, which resumes every Slurm row), failing that whether Slurm still lists the job as pending or
  running (or in a state this worker does not know). So reconcile never fails a job merely queued on the
  cluster, nor one that Slurm did not answer for.
- `wake`: nothing: the poller looks at every row each cycle.
- `abandon`: a plain scancel of the job before reconcile fails its row (None if scancel did not answer).
- a queued row's cancel only flags it: it may start on a node any moment; the poller scancels it.
- `profile`: the tier's `slurm_resources` (batch size and precision fit every GPU its gres allows);
  `visible_devices`: None (the node's Slurm sets CUDA_VISIBLE_DEVICES to the GPU it allocated); `files_dir`: the
  Slurm log dir, which the node reads (a job's dataset config);
  `readiness`: the cluster's deep checks (health.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lora_worker.checks import Check
from lora_worker.config import Settings, TrainerProfile
from lora_worker.errors import LaunchFailed
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job
from lora_worker.slurm import NAME
from lora_worker.slurm.health import cluster_checks
from lora_worker.slurm.process import ensure_poller, poller_running, replace_stuck, stuck_poller
from lora_worker.slurm.sbatch import submit
from lora_worker.slurm.scheduler import Scheduler, SchedulerUnavailable
from lora_worker.slurm.states import stage


@dataclass
class SlurmBackend:
    """`scheduler` and `start_poller` are Slurm's commands and `ensure_poller` unless a test gives others."""

    scheduler: Scheduler | None = None
    start_poller: Callable[[Settings], None] = ensure_poller
    db: Database | None = None
    name: str = field(default=NAME, init=False)
    label: str = field(default="Slurm", init=False)
    places_here: bool = field(default=False, init=False)  # Slurm allocates the GPU; its cgroup holds the job
    cancels_queued_at_once: bool = field(default=False, init=False)

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
        job = repo.find_job(self._db(settings), job_id)
        if job is None or job.backend != self.name:
            return False
        if self._poller_well(settings):
            return True
        try:
            self.start_poller(settings)
            return True
        except LaunchFailed:
            pass
        if job.slurm_job_id is None:
            return False  # never submitted; reconcile's launch grace covers a submission under way
        try:
            return stage(self._scheduler(settings).queue([job.slurm_job_id]).get(job.slurm_job_id)).listed_alive
        except SchedulerUnavailable:
            return True  # what cannot be seen is not failed: the poller, once back, settles it

    def _poller_well(self, settings: Settings) -> bool:
        """A poller holds the lock and beats; a stuck one is killed so that another can take over."""
        if not poller_running(settings):
            return False
        stuck = stuck_poller(settings)
        return stuck is None or not replace_stuck(settings, stuck)

    def wake(self, job: Job) -> None:
        """The poller sees the flag at its next cycle (every `slurm_poll_interval_s`)."""

    def abandon(self, job: Job, settings: Settings) -> tuple[int, ...] | None:
        if job.slurm_job_id is None:
            return ()
        try:
            self._scheduler(settings).cancel(job.slurm_job_id)
        except SchedulerUnavailable:
            return None  # not known to be stopped: the row is not ended yet
        return ()

    def slots(self, settings: Settings) -> list[str]:
        return [f"{self.name}-{k}" for k in range(settings.max_active_jobs)]

    def profile(self, settings: Settings, tier: str, device_index: int) -> TrainerProfile:
        resources = settings.slurm_resources[tier]  # device_index has no effect: Slurm picks the GPU
        return TrainerProfile(resources.train_batch_size, resources.mixed_precision)

    def visible_devices(self, device_index: int) -> str | None:
        return None

    def files_dir(self, settings: Settings) -> Path:
        return settings.slurm_logs  # storage the node reads too, as it reads the job's spec there

    def readiness(self, settings: Settings, *, trainer: bool) -> list[Check]:
        return cluster_checks(settings, self._scheduler(settings), trainer=trainer)


def _cancel_quietly(scheduler: Scheduler, slurm_job_id: str) -> None:
    try:
        scheduler.cancel(slurm_job_id)
    except SchedulerUnavailable:
        pass

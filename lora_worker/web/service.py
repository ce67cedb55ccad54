"""The worker's operations, one function per thing a client can ask. Views call these and nothing else;
dispatch itself lives in `lora_worker.dispatch`."""
from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lora_worker.config import Settings
from lora_worker.errors import JobNotFound, NvmlUnavailable
from lora_worker.host import sandbox
from lora_worker.host.nvml import Nvml
from lora_worker.web.gpu_status import gpu_status
from lora_worker.dispatch.dispatcher import Dispatcher
from lora_worker.dispatch.request import TrainRequest
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job, ProgressPoint
from lora_worker.reconcile import current_job, reconcile
from lora_worker.backends import Backend
from lora_worker.run.local import wake_supervisor
from lora_worker.transcript.logfile import LogChunk, LogReader
from lora_worker.states import TERMINAL_STATES, JobState

log = logging.getLogger(__name__)

MAX_JOB_ID = 2**63 - 1  # SQLite's INTEGER; anything larger cannot name a job
LONG_POLL_INTERVAL_S = 0.2


@dataclass(frozen=True)
class Polled:
    """A long poll's answer: the job, and `retry_after_s` when it could not wait (every slot was taken)."""

    job: Job
    retry_after_s: int | None = None


def retry_after_s(wait_s: float) -> int:
    """How long a long poll turned away should wait before it asks again: between half and all of the wait it
    asked for, in whole seconds (Retry-After's unit), drawn at random.

    Answering it at once with nothing more made the turned-away pollers ask again at once, a busy loop (with
    256 of them, ~800 requests a second, and another client's request waited 295 ms). The client was ready to
    wait `wait_s` for news anyway; the spread keeps pollers turned away together from coming back together.
    """
    whole = max(1, math.ceil(wait_s))
    return random.randint(max(1, math.ceil(whole / 2)), whole)


@dataclass
class Worker:
    """What every operation needs: settings, the ledger, NVML, and the backend that runs jobs."""

    settings: Settings
    db: Database
    nvml: Nvml
    backend: Backend

    def __post_init__(self) -> None:
        self._long_polls = threading.BoundedSemaphore(self.settings.long_poll_slots)
        self.dispatcher = Dispatcher(self.settings, self.db, self.nvml, self.backend)

    def submit(self, request: TrainRequest, *, idempotency_key: str | None = None,
               body_sha256: str | None = None) -> tuple[Job, bool]:
        self.reconcile_active()  # a dead supervisor's job must not hold the slot
        return self.dispatcher.submit(request, idempotency_key=idempotency_key, body_sha256=body_sha256)

    # -- reading -----------------------------------------------------------------------------------------

    def job(self, job_id: int, *, wait_s: float = 0.0, since: int | None = None) -> Polled:
        """A job as the ledger has it. With `since`, wait up to `wait_s` for its version to differ from it;
        when no long-poll slot is free, the job at once with the seconds to wait before asking again."""
        job = self._job_now(job_id)
        if since is None or job.version != since or wait_s <= 0:
            return Polled(job)
        if not self._long_polls.acquire(blocking=False):
            return Polled(job, retry_after_s=retry_after_s(wait_s))
        try:
            return Polled(self._waited(job, wait_s, lambda j: j.version != since))
        finally:
            self._long_polls.release()

    def _wait(self, job: Job, wait_s: float, done: Callable[[Job], bool]) -> Job:
        """`job` as it is once `done(job)` holds, or after `wait_s` seconds.

        Waiting takes one of a few long-poll slots, fewer than gunicorn's threads, so waiting clients can
        never leave a cancel without a thread; when the slots are taken, the answer comes at once.
        """
        if wait_s <= 0 or done(job) or not self._long_polls.acquire(blocking=False):
            return job
        try:
            return self._waited(job, wait_s, done)
        finally:
            self._long_polls.release()

    def _waited(self, job: Job, wait_s: float, done: Callable[[Job], bool]) -> Job:
        """The wait itself, in a long-poll slot the caller holds."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(LONG_POLL_INTERVAL_S, left))
            job = self._job_now(job.id)
            if done(job):
                break
        return job

    def progress(self, job_id: int, points: int) -> tuple[Job, list[ProgressPoint]]:
        """The loss curve, thinned to at most `points` evenly spaced steps (the last one always kept)."""
        job = self._job_now(job_id)
        series = repo.progress_points(self.db, job_id)
        if len(series) > points:
            last = len(series) - 1
            picks = sorted({round(i * last / (points - 1)) for i in range(points)}) if points > 1 else [last]
            series = [series[i] for i in picks]
        return job, series

    def _job_now(self, job_id: int) -> Job:
        """A job as the ledger has it, after reconciling it if it claims to be active."""
        if not 0 < job_id <= MAX_JOB_ID:
            raise JobNotFound(f"No job has id {job_id}.", job_id=job_id)
        return current_job(self.db, self.settings, job_id, actor="api", backend=self.backend)

    def jobs(self, *, status: list[str], limit: int, before_id: int | None) -> list[Job]:
        self.reconcile_active()
        return repo.list_jobs(self.db, status=status, limit=limit, before_id=before_id)

    def log(self, job_id: int, *, lines: int | None, offset: int | None, limit: int) -> LogChunk:
        self._job_now(job_id)
        reader = LogReader(self.settings.log_dir, job_id)
        if offset is not None:
            return reader.read_from(offset, limit)
        return reader.tail_lines(lines if lines is not None else 100)

    def cancel(self, job_id: int, *, wait_s: float = 0.0) -> Job:
        """Ask the job to stop; with `wait_s`, answer once it has ended (cancelled, or whatever it ended as)
        or after `wait_s` seconds with its state then. The wait takes a long-poll slot like GET's."""
        self._job_now(job_id)
        job = repo.request_cancel(self.db, job_id, actor="api")
        if job.status == JobState.RUNNING.value:
            # The flag is committed; the supervisor would see it at its next poll (0.5 s). This wakes it now.
            # Any backend's: the row names its supervisor's process, and one on another host (another boot
            # id) or none at all is simply left to that poll.
            wake_supervisor(job.boot_id, job.supervisor_pid, job.supervisor_start_ticks)
        return self._wait(job, wait_s, lambda j: JobState(j.status) in TERMINAL_STATES)

    def gpu_status(self) -> dict[str, Any]:
        self.reconcile_active()  # a dead supervisor's job is neither active nor "ours"
        return gpu_status(self.nvml.read(), self.settings, repo.active_job(self.db))

    def health(self) -> dict[str, Any]:
        problem = self.db.identity_problem()
        if problem is not None:
            # Not the ledger we opened: nothing about jobs can be said, and nothing must be written.
            return {"status": "failing", "ledger": problem, "active_job_id": None, "active_job_ids": [],
                    "nvml": "not checked", "sandbox": sandbox.describe(self.settings)}
        self.reconcile_active()
        active_ids = [job.id for job in repo.active_jobs(self.db)]  # one read: the oldest is active_job_id
        try:
            self.nvml.read()
            nvml = "ok"
        except NvmlUnavailable as exc:
            nvml = f"unavailable: {exc.message}"
        return {"status": "ok", "ledger": "ok", "active_job_id": active_ids[0] if active_ids else None,
                "active_job_ids": active_ids, "nvml": nvml,
                "trainer": self.settings.trainer_kind, "sandbox": sandbox.describe(self.settings)}

    def reconcile_active(self) -> None:
        reconcile(self.db, self.settings, actor="api", backend=self.backend)

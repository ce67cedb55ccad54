"""The worker's operations, one function per thing a client can ask. Views call these and nothing else;
dispatch itself lives in `lora_worker.dispatch`."""
from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_worker.config import Settings
from lora_worker.errors import EventNotFound, JobGone, JobNotFound, LogUnreadable, NvmlUnavailable
from lora_worker.host import fs, sandbox
from lora_worker.host.nvml import Nvml
from lora_worker.web.gpu_status import gpu_status
from lora_worker.dispatch import auto_resume, gallery, promote, resumable, resume
from lora_worker.dispatch.dispatcher import Dispatcher
from lora_worker.dispatch.readiness import DeepHealth
from lora_worker.dispatch.request import TrainRequest
from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job, ProgressPoint
from lora_worker.reconcile import current_job, reconcile
from lora_worker.backends import Backend, backend_of
from lora_worker.transcript.logfile import log_paths
from lora_worker.transcript.logreader import LogChunk, LogReader
from lora_worker.webhooks.process import ensure_sender
from lora_worker.states import TERMINAL_STATES, JobState

log = logging.getLogger(__name__)

MAX_JOB_ID = 2**63 - 1  # SQLite's INTEGER; anything larger cannot name a job
LONG_POLL_INTERVAL_S = 0.2
# Reconcile (a dead supervisor's job marked failed) runs at start-up, every RECONCILE_EVERY_S from a thread of
# the web process (web/app.py: start_reconcile_timer), and on an authenticated request at most once every
# RECONCILE_MIN_GAP_S. Never from /healthz: it is open, and anyone polling it must not make the worker write,
# kill or query Slurm.
RECONCILE_EVERY_S = 30.0
RECONCILE_MIN_GAP_S = 5.0


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


def orphan_log_size(log_dir: Path, job_id: int) -> int | None:
    """The size of `logs/job-<id>.log` if it is a regular file there, else None. Opened without following a
    link (at logs/ or at the file) and without blocking (a FIFO planted there cannot hold the request)."""
    try:
        dir_fd = os.open(log_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fd, st = fs.open_regular(dir_fd, log_paths(log_dir, job_id)[0].name)
        os.close(fd)
        return st.st_size
    except OSError:  # absent, a link, a FIFO, a device: nothing known
        return None
    finally:
        os.close(dir_fd)


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
        self._reconciled_at = -math.inf  # time.monotonic() of the last request-driven reconcile
        self._reconcile_gate = threading.Lock()
        self.deep_health = DeepHealth(self.settings, self.nvml, self.backend)  # the backend of new jobs

    def submit(self, request: TrainRequest, *, idempotency_key: str | None = None,
               body_sha256: str | None = None) -> tuple[Job, bool]:
        self.reconcile_active()  # a dead supervisor's job must not hold the slot
        accepted = self.dispatcher.submit(request, idempotency_key=idempotency_key, body_sha256=body_sha256)
        ensure_sender(self.settings)  # its job.queued is in the outbox; a sender must be there to send it
        return accepted

    def plan(self, request: TrainRequest) -> dict[str, Any]:
        """A dry run (dispatch/dispatcher.py `plan`): the slot is judged as a real POST judges it, so a dead
        supervisor's job is reconciled first; no sender is started, for no event is written."""
        self.reconcile_active()
        return self.dispatcher.plan(request)

    def resume(self, job_id: int, *, idempotency_key: str | None = None) -> tuple[Job, bool]:
        """A new job continuing `job_id` from its newest good state (dispatch/resume.py)."""
        self.reconcile_active()
        self._job_now(job_id)
        accepted = resume.resume(self.dispatcher, job_id, idempotency_key=idempotency_key)
        ensure_sender(self.settings)
        return accepted

    def resume_verdict(self, job_id: int) -> dict[str, Any]:
        return resumable.verdict(self.db, self.settings, self._job_now(job_id)).as_dict()

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
        try:
            return current_job(self.db, self.settings, job_id, actor="api", backend=self.backend)
        except JobNotFound:
            size = orphan_log_size(self.settings.log_dir, job_id)
            if size is None:
                raise
            log_path = log_paths(self.settings.log_dir, job_id)[0]
            raise JobGone(f"Job {job_id} is not in the ledger (it was lost: deleted or replaced), but its run log "
                          f"is still at {log_path} ({size} bytes).", job_id=job_id, ledger="lost",
                          log_path=str(log_path), log_bytes=size) from None

    def jobs(self, *, status: list[str], limit: int, before_id: int | None) -> list[Job]:
        self.reconcile_active()
        return repo.list_jobs(self.db, status=status, limit=limit, before_id=before_id)

    def log(self, job_id: int, *, lines: int | None, offset: int | None, limit: int) -> LogChunk:
        self._job_now(job_id)
        reader = LogReader(self.settings.log_dir, job_id)
        try:
            if offset is not None:
                return reader.read_from(offset, limit)
            return reader.tail_lines(lines if lines is not None else 100)
        except OSError as exc:  # a link or a FIFO where the log was: refused at once, never waited on
            raise LogUnreadable(f"The run log of job {job_id} cannot be read: {exc}.", job_id=job_id) from exc

    def cancel(self, job_id: int, *, wait_s: float = 0.0) -> Job:
        """Ask the job to stop; with `wait_s`, answer once it has ended (cancelled, or whatever it ended as)
        or after `wait_s` seconds with its state then. The wait takes a long-poll slot like GET's."""
        runs = backend_of(self._job_now(job_id), self.backend)
        job = repo.request_cancel(self.db, job_id, actor="api", queued_at_once=runs.cancels_queued_at_once)
        if job.status == JobState.RUNNING.value:
            # The flag is committed; whoever attends the job would see it at its next look (0.5 s locally).
            # This tells it now.
            runs.wake(job)
        return self._wait(job, wait_s, lambda j: JobState(j.status) in TERMINAL_STATES)

    def samples(self, job_id: int) -> dict[str, Any]:
        """The job's sample images with their prompts and step LoRAs (dispatch/gallery.py)."""
        return gallery.listing(self.db, self._job_now(job_id))

    def sample_image(self, job_id: int, name: str) -> bytes:
        return gallery.image(self.db, self._job_now(job_id), name)

    def contact_sheet(self, job_id: int) -> bytes:
        return gallery.sheet(self.db, self._job_now(job_id))

    def promote(self, job_id: int, step: int) -> tuple[Job, bool]:
        """The verified step LoRA of `step` made the job's result (dispatch/promote.py)."""
        accepted = promote.promote(self.db, self._job_now(job_id), step)
        ensure_sender(self.settings)  # its job.promoted is in the outbox
        return accepted

    def deliveries(self, job_id: int) -> list[dict[str, Any]]:
        """Each webhook event of the job, with each attempt to deliver it."""
        self._job_now(job_id)
        with self.db.reading() as db:
            return outbox.deliveries(db, job_id)

    def redeliver(self, job_id: int, event_id: str) -> dict[str, Any]:
        """Send one event again, under its own id, whatever became of it; the sender picks it up at once."""
        self._job_now(job_id)
        with self.db.writing() as db:
            if not outbox.redeliver(db, job_id, event_id, self.settings.webhook_give_up_s):
                raise EventNotFound(f"Job {job_id} has no webhook event {event_id!r}.", job_id=job_id,
                                    event_id=event_id)
        ensure_sender(self.settings)
        return next(e for e in self.deliveries(job_id) if e["event_id"] == event_id)

    def gpu_status(self) -> dict[str, Any]:
        self.reconcile_active()  # a dead supervisor's job is neither active nor "ours"
        return gpu_status(self.nvml.read(), self.settings, repo.active_job(self.db))

    def health(self) -> dict[str, Any]:
        """What /healthz says. It only reads: no reconcile (no ledger write, no kill, no Slurm query)."""
        problem = self.db.identity_problem()
        if problem is not None:
            # Not the ledger we opened: nothing about jobs can be said, and nothing must be written.
            return {"status": "failing", "ledger": problem, "active_job_id": None, "active_job_ids": [],
                    "nvml": "not checked", "sandbox": sandbox.describe(self.settings)}
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
        auto_resume.follow_up(self.dispatcher)  # a job a reboot cut off: resumed once, or marked resumable

    def reconcile_if_due(self) -> bool:
        """Reconcile unless one ran in the last RECONCILE_MIN_GAP_S (or is running now); whether it ran."""
        if not self._reconcile_gate.acquire(blocking=False):
            return False
        try:
            if time.monotonic() - self._reconciled_at < RECONCILE_MIN_GAP_S:
                return False
            self._reconciled_at = time.monotonic()
            self.reconcile_active()
            return True
        finally:
            self._reconcile_gate.release()

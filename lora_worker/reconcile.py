"""Reconcile: active rows whose supervisor is gone become `failed`, so no phantom "running" job survives a
crash. Cheap enough to run at start-up (`lora-worker reconcile`, ExecStartPre) and on every request that
touches an active row.

"Is the job attended?" is asked of the row's own backend (backends.py `backend_of`); the local one answers with
the supervisor's flock, which the kernel drops when it dies (zombie or not). Before the row is failed, the
backend stops what of the job may still run (`abandon`): a local leftover trainer is killed only if its
identity matches the row (run/leftovers.py), a Slurm job is scancelled; a row whose job cannot be made sure
to be stopped is left for a later reconcile. A row is failed only once what was killed is gone: a process that
outlives SIGKILL (state D) keeps the job active, and so its GPU from any new job, and the job's events and run
log say which (`still_running`). The failed row quotes the end of the job's run log, as a failure the supervisor
wrote would.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from lora_worker.config import Settings
from lora_worker.errors import LoraWorkerError
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job, utcnow
from lora_worker.transcript.explain import quotable
from lora_worker.transcript.logfile import append_note
from lora_worker.transcript.logreader import LogReader
from lora_worker.states import ACTIVE_STATES, FailureClass, JobState
from lora_worker.host import processes
from lora_worker.backends import Backend, backend_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Action:
    job_id: int
    failure_class: FailureClass
    killed: tuple[int, ...]


def reconcile(db: Database, settings: Settings, *, actor: str = "reconcile",
              backend: Backend | None = None) -> list[Action]:
    """Mark every unattended active job failed; returns what was done. A job whose reconcile fails unexpectedly is
    logged (its traceback, once a process) and left for the next round; the others are reconciled all the same.
    A ledger that is busy or gone (LoraWorkerError) stops the round: no job's row can be written."""
    actions = []
    for job in repo.active_jobs(db):
        try:
            action = reconcile_job(db, settings, job, actor=actor, backend=backend)
        except LoraWorkerError:
            raise
        except Exception:  # noqa: BLE001 - contained to this job: the next round tries it again
            if job.id not in _FAILED:
                _FAILED.add(job.id)
                log.exception("job %s: reconcile failed; it is left as it is for the next round", job.id,
                              extra={"job": job.id})
            continue
        if action is not None:
            actions.append(action)
    return actions


_FAILED: set[int] = set()  # the jobs whose reconcile failed, logged with a traceback once a process


def current_job(db: Database, settings: Settings, job_id: int, *, actor: str, backend: Backend | None = None) -> Job:
    """A job as the ledger has it, reconciled first when it claims to be active: a reader never sees a dead
    supervisor's job as running."""
    job = repo.get_job(db, job_id)
    if JobState(job.status) in ACTIVE_STATES and reconcile_job(db, settings, job, actor=actor, backend=backend):
        job = repo.get_job(db, job_id)
    return job


def reconcile_job(db: Database, settings: Settings, job: Job, *, actor: str = "reconcile",
                  backend: Backend | None = None) -> Action | None:
    """`backend` is the worker's own (or a test's); a row of another backend is asked of its own."""
    runs = backend_of(job, backend)
    if runs.attended(job.id, settings):
        return None  # its supervisor is alive
    if job.status == JobState.QUEUED.value and utcnow() - job.created_at < timedelta(seconds=settings.launch_grace_s):
        return None  # being launched right now
    try:
        failure, killed, reason = _what_is_left(job, settings, runs)
    except processes.OutlivedKill as exc:
        still_running(db, settings, job, exc, actor)
        return None
    if killed is None:
        return None  # not known to be stopped: the row is not ended while the job may still run
    sentence = reason[0].upper() + reason[1:]
    if not repo.fail_job(db, job.id, actor=actor, failure_class=failure, sentence=sentence,
                         log_lines=log_tail(settings, job.id)):
        return None  # the supervisor's own final write won the race
    close_log(settings, job.id, f"reconcile ({actor}): {sentence}; the job is failed ({failure.value})")
    log.warning("job %s: %s", job.id, reason, extra={"job": job.id})
    return Action(job.id, failure, killed)


def _what_is_left(job: Job, settings: Settings, runs: Backend) -> tuple[FailureClass, tuple[int, ...] | None, str]:
    """How the job ended for reconcile, and what of it was stopped first (None: nothing could be made sure)."""
    if job.boot_id and job.boot_id != processes.boot_id():
        return FailureClass.HOST_REBOOTED, (), "the host rebooted while the job was running"
    killed = runs.abandon(job, settings)
    if job.status == JobState.QUEUED.value:
        return FailureClass.SUPERVISOR_LOST, killed, "the supervisor never started"
    reason = "the supervisor died; " + (f"killed its leftover processes {list(killed)}" if killed
                                         else "no process of the job was left")
    return FailureClass.SUPERVISOR_LOST, killed, reason


def still_running(db: Database, settings: Settings, job: Job, outlived: processes.OutlivedKill, actor: str) -> None:
    """Processes of the job outlived SIGKILL: the row stays active, so no new job is admitted while they hold the
    GPU (the one-active-job index), and says why in an event and in the run log, once; a later reconcile ends
    it when they are gone."""
    reason = (f"the supervisor died; its processes {list(outlived.pids)} outlived SIGKILL for {outlived.waited_s:g} s; "
              "the job stays running, holding its GPU, until they are gone")
    if repo.note_active(db, job.id, actor=actor, reason=reason):
        log.error("job %s: %s", job.id, reason, extra={"job": job.id})
        close_log(settings, job.id, f"reconcile ({actor}): {reason[0].upper()}{reason[1:]}")


def close_log(settings: Settings, job_id: int, line: str) -> None:
    """The run log's last line says what reconcile found and did: the supervisor that would have closed it is
    gone. A log that cannot be written loses only that line; the ledger has the outcome."""
    try:
        append_note(settings.log_dir, job_id, line, head_bytes=settings.log_head_bytes)
    except OSError as exc:
        log.warning("job %s: cannot close its run log (%s)", job_id, exc)


def log_tail(settings: Settings, job_id: int) -> list[str]:
    """The last lines of the job's run log that a failure may quote (none if the supervisor never opened it):
    the launcher's traceback and argv dump left out, as the supervisor leaves them out."""
    try:
        lines = LogReader(settings.log_dir, job_id).tail_lines(4 * repo.FAILURE_TAIL_LINES).text.splitlines()
        return quotable(lines)[-repo.FAILURE_TAIL_LINES:]
    except OSError as exc:  # the failure is recorded all the same, without its quote
        log.warning("job %s: cannot read its run log (%s)", job_id, exc)
        return []

"""Reconcile: active rows whose supervisor is gone become `failed`, so no phantom "running" job survives a
crash. Cheap enough to run at start-up (`lora-worker reconcile`, ExecStartPre) and on every request that
touches an active row.

"Is the job attended?" is asked of its backend (backends.py); the local one answers with the supervisor's
flock, which the kernel drops when it dies (zombie or not).
A leftover trainer is killed only if its identity matches the row: a pid now used by a stranger is never
signalled. The failed row quotes the end of the job's run log, as a failure the supervisor wrote would.
"""
from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from datetime import timedelta

from lora_worker.config import Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job, utcnow
from lora_worker.transcript.explain import quotable
from lora_worker.transcript.logfile import LogReader, append_note
from lora_worker.states import ACTIVE_STATES, FailureClass, JobState
from lora_worker.host import processes
from lora_worker.backends import Backend, backend_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Action:
    job_id: int
    failure_class: FailureClass
    killed: tuple[int, ...]


def reconcile(db: Database, settings: Settings, *, actor: str = "reconcile",
              backend: Backend | None = None) -> list[Action]:
    """Mark every unattended active job failed; returns what was done."""
    actions = []
    for job in repo.active_jobs(db):
        action = reconcile_job(db, settings, job, actor=actor, backend=backend)
        if action is not None:
            actions.append(action)
    return actions


def current_job(db: Database, settings: Settings, job_id: int, *, actor: str, backend: Backend | None = None) -> Job:
    """A job as the ledger has it, reconciled first when it claims to be active: a reader never sees a dead
    supervisor's job as running."""
    job = repo.get_job(db, job_id)
    if JobState(job.status) in ACTIVE_STATES and reconcile_job(db, settings, job, actor=actor, backend=backend):
        job = repo.get_job(db, job_id)
    return job


def reconcile_job(db: Database, settings: Settings, job: Job, *, actor: str = "reconcile",
                  backend: Backend | None = None) -> Action | None:
    if (backend or backend_for(settings)).attended(job.id, settings):
        return None  # its supervisor is alive
    if job.status == JobState.QUEUED.value and utcnow() - job.created_at < timedelta(seconds=settings.launch_grace_s):
        return None  # being launched right now
    killed: tuple[int, ...]
    if job.boot_id and job.boot_id != processes.boot_id():
        failure, killed = FailureClass.HOST_REBOOTED, ()
        reason = "the host rebooted while the job was running"
    else:
        failure, killed = FailureClass.SUPERVISOR_LOST, tuple(kill_leftovers(job))
        reason = "the supervisor died; " + (f"killed its leftover processes {list(killed)}" if killed
                                             else "no process of the job was left")
        if job.status == JobState.QUEUED.value:
            reason = "the supervisor never started"
    sentence = reason[0].upper() + reason[1:]
    if not repo.fail_job(db, job.id, actor=actor, failure_class=failure, sentence=sentence,
                         log_lines=log_tail(settings, job.id)):
        return None  # the supervisor's own final write won the race
    close_log(settings, job.id, f"reconcile ({actor}): {sentence}; the job is failed ({failure.value})")
    log.warning("job %s: %s", job.id, reason, extra={"job": job.id})
    return Action(job.id, failure, killed)


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


def kill_leftovers(job: Job) -> list[int]:
    """SIGKILL what is left of the job's processes, if and only if they are provably ours; returns the pids
    that were alive and got the signal (nothing else: a claim of "killed" must be true).

    Under the sandbox the job is a PID namespace whose init dies with the supervisor, so normally nothing is
    left. Its leader (bwrap) may still be alive if the supervisor died in the instant after starting it: then the
    namespace's init is killed too, and the kernel takes every process in the namespace with it.
    """
    if not job.trainer_pid or job.boot_id != processes.boot_id():
        return []
    leader = processes.Identity(job.boot_id, job.trainer_pid, job.trainer_start_ticks or -1)
    # Our output dir is in the trainer's and launcher's argv: a member that shows it is ours even when the
    # group's leader (the launcher) is gone. A reused pid cannot lead a group while our group still exists.
    token = next((a for a in job.argv if a.startswith("--output_dir=")), None)
    members = processes.group_members(job.trainer_pid)
    leader_alive = processes.matches(leader)
    ours = leader_alive or any(token and processes.cmdline_contains(pid, token) for pid in members)
    if not ours:
        return []
    namespace_init = processes.sandbox_init(job.trainer_pid) if leader_alive else None
    namespace = processes.pid_namespace(namespace_init) if namespace_init else None
    in_namespace = processes.namespace_members(namespace) if namespace else []
    killed = [pid for pid in dict.fromkeys([*members, *in_namespace]) if _kill(pid)]
    processes.signal_group(job.trainer_pid, signal.SIGKILL)  # anything forked while we looked
    # Without the sandbox, a grandchild that started its own session escaped the group; its argv may still
    # name our output dir (one that re-exec'd itself under another name is only caught by the sandbox).
    escaped = [pid for pid in processes.processes_with_arg(token) if pid not in killed] if token else []
    for pid in escaped:
        ident = processes.identity_of(pid)
        if ident is not None and ident.start_ticks >= (job.trainer_start_ticks or 0) \
                and processes.signal_identity(ident, signal.SIGKILL):
            killed.append(pid)
    return killed


def _kill(pid: int) -> bool:
    ident = processes.identity_of(pid)
    return ident is not None and processes.signal_identity(ident, signal.SIGKILL)

"""The ledger's part of a resume (migration 0014): which job resumed which, the events that say so, and the jobs
a reboot cut off that no resume has looked at yet."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, Select, and_, exists, select

from lora_worker.ledger.db import Database
from lora_worker.ledger.checkpoints import STATE
from lora_worker.ledger.models import Checkpoint, Job, JobEvent
from lora_worker.ledger.repository import _event
from lora_worker.states import TERMINAL_STATES, FailureClass, JobState

NOTE_PREFIX = "resume: "  # the events `follow_up` writes: a job with one was looked at


def resume_of(db: Database, job_id: int) -> Job | None:
    """The job that resumed `job_id`, if one did. A resume whose launch failed before any trainer ran (failed
    `launch_error`: the sbatch or the supervisor never started, or refused before exec) resumed nothing and does
    not count: the job is resumed again, by a retry with the same Idempotency-Key or by auto_resume."""
    with db.read() as s:
        return s.scalars(select(Job).where(Job.resumed_from == job_id, counts_as_resume()).order_by(Job.id)).first()


def counts_as_resume() -> ColumnElement[bool]:
    """The rows that resumed their `resumed_from`: all but a launch that never ran a trainer."""
    return Job.failure_class.is_(None) | (Job.failure_class != FailureClass.LAUNCH_ERROR.value)


def launches_failed(db: Database, job_id: int) -> int:
    """How many resumes of `job_id` failed to launch (failed `launch_error`)."""
    with db.read() as s:
        return len(s.scalars(select(Job.id).where(Job.resumed_from == job_id,
                                                  Job.failure_class == FailureClass.LAUNCH_ERROR.value)).all())


def states_seen(db: Database, job_id: int) -> set[int]:
    """The steps of the states the job's trainer said it saved (`saving state at step N`), as its progress writes
    recorded them (migration 0013), removed since or not."""
    with db.read() as s:
        return set(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id, Checkpoint.kind == STATE)))


def lora_files_kept(db: Database, cutoff: datetime) -> set[str]:
    """The LoRA files of every job retention keeps at `cutoff` (active, or ended since): a pruned job shares its
    output directory, and its states' names, with a resume of it that is kept, whose states are not its to remove."""
    ended_before = and_(Job.status.in_([s.value for s in TERMINAL_STATES]), Job.finished_at < cutoff)
    with db.read() as s:
        return set(s.scalars(select(Job.lora_file).where(~ended_before, Job.lora_file.is_not(None)).distinct()))


def note(db: Database, job_id: int, *, actor: str, reason: str) -> None:
    """An event of the job that changes no state (a resume of it started, reconcile found it resumable)."""
    with db.write() as s:
        job = s.get(Job, job_id)
        if job is not None:
            _event(s, job_id, JobState(job.status), JobState(job.status), actor, reason)


def cut_off_unlooked(db: Database, limit: int = 20) -> list[Job]:
    """Failed `host_rebooted` jobs no resume follows and no `resume: ` event has looked at, oldest first."""
    with db.read() as s:
        return list(s.scalars(cut_off_query(limit)))


def cut_off_query(limit: int) -> Select[Job]:
    """Read through `ix_jobs_status_failure_class` (migration 0015): every web reconcile runs it, so its cost
    must not grow with the failed jobs of other classes."""
    later = select(Job.resumed_from).where(Job.resumed_from.is_not(None), counts_as_resume())
    looked = exists().where(JobEvent.job_id == Job.id, JobEvent.reason.like(f"{NOTE_PREFIX}%"))
    return (select(Job).where(Job.status == JobState.FAILED.value,
                              Job.failure_class == FailureClass.HOST_REBOOTED.value,
                              Job.id.not_in(later), ~looked).order_by(Job.id).limit(limit))

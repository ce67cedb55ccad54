"""Every piece of job SQL the worker issues. Callers never write to `jobs` any other way.

Each state change is a compare-and-set inside one BEGIN IMMEDIATE transaction and leaves a `job_events`
row, so a late writer (a supervisor whose job was reconciled meanwhile) loses instead of overwriting.
A row becomes `failed` through `fail_job` only, so every failure reads the same way whoever wrote it.
The statements the supervisor also issues (state changes, progress, the cancel probe, the ETA's history) are
written once in `statements.py` and run here on the Session's own connection (`_Driver`).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, cast

import sqlalchemy.exc
from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import CursorResult, Result
from sqlalchemy.orm import Session, defer

from lora_worker.errors import JobActive, JobFinished, JobNotFound
from lora_worker.ledger import outbox
from lora_worker.ledger import statements as sql
from lora_worker.ledger.counts import Counts as Counts, counts as counts  # what /metrics reads
from lora_worker.ledger.db import Database
from lora_worker.ledger.db import Driver as _Driver
from lora_worker.ledger.models import Job, JobEvent, ProgressPoint, utcnow
# The failure text's shape and the progress SQL live with the statements both ledger paths share.
from lora_worker.ledger.statements import (FAILURE_MAX_CHARS, FAILURE_TAIL_LINES as FAILURE_TAIL_LINES,  # noqa: F401
                                           PROGRESS_POINT_SQL,
                                           SENTENCE_MAX_CHARS, failure_text)
from lora_worker.states import ACTIVE_STATES, TERMINAL_STATES, FailureClass, JobState


def create_job(db: Database, columns: dict[str, Any], *, actor: str = "api") -> Job:
    """Insert a queued job. The one-active-job index turns a second active job into JobActive."""
    now = utcnow()
    try:
        with db.write() as s:
            job = Job(status=JobState.QUEUED.value, created_at=now, updated_at=now, step=0, version=1, **columns)
            s.add(job)
            s.flush()
            _event(s, job.id, None, JobState.QUEUED, actor, "accepted")
            outbox.emit(_on(s), job.id, outbox.QUEUED)  # committed with the row, or not at all
    except sqlalchemy.exc.IntegrityError as exc:
        if "jobs.lora_file" in str(exc):
            raise lora_file_taken(db, str(columns.get("lora_file"))) from exc
        if "jobs.slot" not in str(exc):
            raise  # e.g. a duplicate idempotency key: the caller looks the key up again
        active = active_job(db)
        raise JobActive(
            f"Job {active.id if active else '?'} is already active; one training runs at a time.",
            active_job_id=active.id if active else None,
        ) from exc
    return job


def lora_file_taken(db: Database, lora_file: str) -> JobActive:
    """The 409 for a second active job on one LoRA file (the index `one_active_job_per_lora`), naming the holder."""
    with db.read() as s:
        holder = s.scalars(select(Job).where(Job.lora_file == lora_file,
                                             Job.status.in_(_values(ACTIVE_STATES)))).first()
    holder_id = holder.id if holder else None
    return JobActive(f"Job {holder_id if holder_id is not None else '?'} is already active and writes {lora_file}; "
                     "a second job would overwrite its LoRA.", active_job_id=holder_id, lora_file=lora_file,
                     retry_after_s=holder.eta_s if holder else None)


def get_job(db: Database, job_id: int) -> Job:
    with db.read() as s:
        job = s.get(Job, job_id)
    if job is None:
        raise JobNotFound(f"No job has id {job_id}.", job_id=job_id)
    return job


def find_job(db: Database, job_id: int) -> Job | None:
    with db.read() as s:
        return s.get(Job, job_id)


def find_by_idempotency_key(db: Database, key: str) -> Job | None:
    with db.read() as s:
        return s.scalars(select(Job).where(Job.idempotency_key == key)).first()


def forget_idempotency_key(db: Database, job_id: int) -> None:
    """An expired key is released so a new request may use it again; the job itself stays."""
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id).values(idempotency_key=None))


def record_output_identity(db: Database, job_id: int, dev_ino: str) -> None:
    """The output directory's identity, known only once dispatch has created it (after the INSERT)."""
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id, Job.status == JobState.QUEUED.value)
                  .values(output_dev_ino=dev_ino))


def record_slurm_job(db: Database, job_id: int, slurm_job_id: str) -> bool:
    """The id sbatch gave the job (slurm/), written once; False if the row is no longer queued."""
    with db.write() as s:
        result = s.execute(update(Job).where(Job.id == job_id, Job.status == JobState.QUEUED.value,
                                             Job.slurm_job_id.is_(None))
                           .values(slurm_job_id=slurm_job_id, updated_at=utcnow(), version=Job.version + 1))
        return _rowcount(result) == 1


def record_queue_reason(db: Database, job_id: int, reason: str | None) -> bool:
    """Why Slurm keeps a queued job waiting (Resources, Priority…); a change a long poll sees (version)."""
    with db.write() as s:
        result = s.execute(update(Job).where(Job.id == job_id, Job.status == JobState.QUEUED.value)
                           .values(queue_reason=reason, updated_at=utcnow(), version=Job.version + 1))
        return _rowcount(result) == 1


def durations_of_similar_jobs(db: Database, *, backend: str, tier: str, device_index: int | None, image_count: int,
                              limit: int = 25) -> list[float]:
    """Wall seconds (start to finish) of the latest succeeded jobs of this backend, tier, image count and card
    (`device_index`; None: any, where the backend's scheduler picks the GPU)."""
    seconds = (func.julianday(Job.finished_at) - func.julianday(Job.started_at)) * 86400.0
    query = (select(seconds).where(Job.status == JobState.SUCCEEDED.value, Job.backend == backend, Job.tier == tier,
                                   Job.image_count == image_count, Job.started_at.is_not(None),
                                   Job.finished_at.is_not(None))
             .order_by(Job.id.desc()).limit(limit))
    if device_index is not None:
        query = query.where(Job.device_index == device_index)
    with db.read() as s:
        return [float(v) for v in s.scalars(query) if v is not None]


def save_and_teardown_durations(db: Database, *, backend: str, tier: str, device_index: int | None,
                                limit: int = 25) -> list[float]:
    """Seconds from the last step to the end of the latest succeeded jobs of this backend, tier and card (see
    `statements.save_and_teardown_in`)."""
    with db.read_connection() as conn:
        return sql.save_and_teardown_in(_Driver(conn), backend=backend, tier=tier, device_index=device_index,
                                        limit=limit)


def active_job(db: Database) -> Job | None:
    with db.read() as s:
        return s.scalars(select(Job).where(Job.status.in_(_values(ACTIVE_STATES)))).first()


def active_jobs(db: Database) -> list[Job]:
    with db.read() as s:
        return list(s.scalars(select(Job).where(Job.status.in_(_values(ACTIVE_STATES))).order_by(Job.id)))


def list_jobs(db: Database, *, status: Sequence[str] = (), limit: int = 50,
              before_id: int | None = None) -> list[Job]:
    """Newest first; `before_id` pages backwards (keyset pagination stays cheap on a long history). The stored
    argv and env are not loaded: no list shows them, and each is a JSON document to decode per row."""
    query = (select(Job).options(defer(Job.argv, raiseload=True), defer(Job.env, raiseload=True))
             .order_by(Job.id.desc()).limit(limit))
    if status:
        query = query.where(Job.status.in_(list(status)))
    if before_id is not None:
        query = query.where(Job.id < before_id)
    with db.read() as s:
        return list(s.scalars(query))


def job_events(db: Database, job_id: int) -> list[JobEvent]:
    with db.read() as s:
        return list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def transition(db: Database, job_id: int, to: JobState, *, actor: str, reason: str | None = None,
               **values: Any) -> bool:
    """Move a job to `to` if its current state allows it; False (and no write) if it does not."""
    with db.write() as s:
        return transition_in(s, job_id, to, actor=actor, reason=reason, **values)


def transition_in(s: Session, job_id: int, to: JobState, *, actor: str, reason: str | None = None,
                  **values: Any) -> bool:
    """`transition` inside the caller's Session: `statements.transition_in` on its connection."""
    return sql.transition_in(_on(s), job_id, to, actor=actor, reason=reason, **values)


def note(db: Database, job_id: int, reason: str, *, actor: str) -> None:
    """An event of a running job that changes no state (running → running), e.g. a file moved aside."""
    with db.write() as s:
        _event(s, job_id, JobState.RUNNING, JobState.RUNNING, actor, reason)


def fail_job(db: Database, job_id: int, *, actor: str, failure_class: FailureClass, sentence: str,
             log_lines: Sequence[str] = (), **values: Any) -> bool:
    """Move a job to `failed`, the one way any code but the supervisor does (its own ledger path runs the same
    `statements.fail_in`): False (and no write) if its state does not allow it.

    The row gets `failure_class`, and `error = failure_text(sentence, log_lines)`; the job's event gets the
    sentence as its reason. `values` are other columns to write in the same transaction (exit status…).
    """
    with db.write() as s:
        return sql.fail_in(_on(s), job_id, actor=actor, failure_class=failure_class, sentence=sentence,
                           log_lines=log_lines, **values)


def note_active(db: Database, job_id: int, *, actor: str, reason: str) -> bool:
    """An event (from == to) on an active job saying why it stays active, unless its latest event says so
    already (reconcile asks on every look at the job); False if nothing was written."""
    with db.write() as s:
        job = s.get(Job, job_id)
        if job is None or JobState(job.status) not in ACTIVE_STATES:
            return False
        latest = s.scalars(select(JobEvent.reason).where(JobEvent.job_id == job_id)
                           .order_by(JobEvent.id.desc()).limit(1)).first()
        if latest == reason:
            return False
        _event(s, job_id, JobState(job.status), JobState(job.status), actor, reason)
        return True


def request_cancel(db: Database, job_id: int, *, actor: str, reason: str = "cancel requested",
                   queued_at_once: bool = True) -> Job:
    """Flag a job for cancellation; a queued one is cancelled at once if its backend says so (`queued_at_once`:
    a queued Slurm job may start any moment, so it is only flagged). Twice is harmless: the flag keeps its
    first time, no second event. A finished one is JobFinished."""
    with db.write() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"No job has id {job_id}.", job_id=job_id)
        state = JobState(job.status)
        if state in TERMINAL_STATES:
            raise JobFinished(f"Job {job_id} already ended ({state.value}); there is nothing to cancel.",
                              job_id=job_id, status=state.value)
        now = utcnow()
        if state is JobState.QUEUED and queued_at_once:
            transition_in(s, job_id, JobState.CANCELLED, actor=actor, reason=reason, cancel_requested_at=now)
        elif job.cancel_requested_at is None:
            flagged = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == state.value, Job.cancel_requested_at.is_(None))
                .values(cancel_requested_at=now, updated_at=now, version=Job.version + 1)
            )
            if _rowcount(flagged) == 1:
                _event(s, job_id, state, state, actor, reason)
        s.flush()
        s.refresh(job)
        return job


def update_running(db: Database, job_id: int, *, points: Iterable[tuple[int, float | None, datetime]] = (),
                   phases: Sequence[Any] = (), actor: str = "supervisor", **values: Any) -> bool:
    """Write progress (or identity) of a running job and its phases; False once it is no longer running."""
    with db.write_connection() as conn:
        return sql.update_running_in(_Driver(conn), job_id, points, phases, actor, **values)


def cancel_state(db: Database, job_id: int) -> tuple[str | None, bool]:
    """(status, whether a cancel is requested)."""
    with db.read_connection() as conn:
        return sql.cancel_state_in(_Driver(conn), job_id)


def _rowcount(result: Result[Any]) -> int:
    # An UPDATE's or a DELETE's result is a CursorResult; Session.execute is typed for any statement.
    return cast("CursorResult[Any]", result).rowcount


def _on(s: Session) -> _Driver:
    return _Driver(s.connection())


def progress_points(db: Database, job_id: int) -> list[ProgressPoint]:
    with db.read() as s:
        return list(s.scalars(select(ProgressPoint).where(ProgressPoint.job_id == job_id)
                              .order_by(ProgressPoint.step)))


def delete_jobs(db: Database, job_ids: Sequence[int]) -> int:
    """Remove finished rows with their events and progress (never an active one)."""
    if not job_ids:
        return 0
    with db.write() as s:
        result = s.execute(
            delete(Job).where(Job.id.in_(list(job_ids)), Job.status.in_(_values(TERMINAL_STATES)))
        )
        return _rowcount(result)


# -- for operators: metrics and retention ---------------------------------------------------------------------

def finished_before(db: Database, cutoff: datetime) -> list[int]:
    """Ids of jobs that ended before `cutoff` (ISO text compares in time order)."""
    query = (select(Job.id).where(Job.status.in_(_values(TERMINAL_STATES)), Job.finished_at < cutoff)
             .order_by(Job.id))
    with db.read() as s:
        return list(s.scalars(query))


def _event(s: Session, job_id: int, frm: JobState | None, to: JobState, actor: str, reason: str | None) -> None:
    sql.record_event(_on(s), job_id, frm, to, actor, reason)


def _values(states: Iterable[JobState]) -> list[str]:
    return sorted(s.value for s in states)

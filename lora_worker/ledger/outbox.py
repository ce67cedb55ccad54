"""The webhook outbox: the events a job's changes leave for arbo, and the sender's reads and writes of them.

An event is a row of `webhook_events`, inserted by the statement that makes the change it tells of and in the
same transaction (`statements.transition_in`, `statements.update_running_in`, `repository.create_job` call
`emit` / `emit_running`): no ending is ever committed without its event, and no event without its ending,
whichever process wrote it (the web, a supervisor, the Slurm poller, reconcile) and through either ledger path.
Only the jobs that subscribed get events: dispatch writes the job's subscription (`jobs.webhook_events`, JSON
`{"types": [...], "progress_interval_s": N}`, NULL for none) once, from the settings and the request.

The body of an event is fixed when it is written (what `GET /train/<id>` said of the job at that moment, in
`data`), so every attempt sends the same bytes under the same `webhook-id`; only the signature's timestamp
differs. `job.progress` is coalesced: while the job's newest event is a progress event nobody has tried to send
yet, a newer step replaces its body (the newest wins), and a new one is written at most once per interval.

DB-API only (`statements.Statements`), like the job statements: nothing here imports SQLAlchemy.
"""
from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from lora_worker.config import WEBHOOK_EVENT_TYPES
from lora_worker.ledger.timestamps import iso_utc, parse_utc, utcnow
from lora_worker.states import JobState, retryable

if TYPE_CHECKING:  # statements.py imports this module: the protocol is only a type here
    from lora_worker.ledger.statements import Statements

QUEUED, STARTED, PHASE, PROGRESS, CHECKPOINT = "job.queued", "job.started", "job.phase", "job.progress", \
    "job.checkpoint"
TERMINAL_EVENTS = {JobState.SUCCEEDED: "job.succeeded", JobState.FAILED: "job.failed",
                   JobState.CANCELLED: "job.cancelled"}
EVENT_TYPES = WEBHOOK_EVENT_TYPES  # the settings check a configured list against the same names

# An event's life. `pending` until a 2xx (`delivered`), the give-up age or a 410 (`given_up`).
PENDING, DELIVERED, GIVEN_UP = "pending", "delivered", "given_up"
EVENT_STATES = (PENDING, DELIVERED, GIVEN_UP)

# What `data` holds: the fields of `GET /train/<id>` a receiver acts on, as that route names them.
DATA_COLUMNS = ("id", "train_id", "status", "phase", "step", "total_steps", "loss", "eta_s", "lora_path",
                "lora_sha256", "lora_size", "failure_class", "error", "exit_code", "signal", "tier",
                "device_index", "backend", "created_at", "started_at", "finished_at", "updated_at", "promoted_step")
_DATA_SQL = f"SELECT {', '.join(DATA_COLUMNS)} FROM jobs WHERE id = ?"
_SUBSCRIPTION_SQL = "SELECT webhook_events FROM jobs WHERE id = ?"
_INSERT_SQL = ("INSERT INTO webhook_events (event_id, job_id, type, body, created_at, state, attempts, "
               "next_attempt_at, give_up_at) VALUES (?, ?, ?, ?, ?, 'pending', 0, ?, ?)")
GIVE_UP_DEFAULT_S = 24 * 3600.0


@dataclass(frozen=True)
class Subscription:
    """Which events a job sends, and how often at most a progress event."""

    types: frozenset[str]
    progress_interval_s: float
    give_up_s: float = GIVE_UP_DEFAULT_S

    def to_json(self) -> str:
        return json.dumps({"types": sorted(self.types), "progress_interval_s": self.progress_interval_s,
                           "give_up_s": self.give_up_s})

    @classmethod
    def from_json(cls, text: str | None) -> Subscription | None:
        if not text:
            return None
        raw = json.loads(text)
        return cls(frozenset(raw.get("types", ())), float(raw.get("progress_interval_s", 30.0)),
                   float(raw.get("give_up_s", GIVE_UP_DEFAULT_S)))


def subscription_of(db: Statements, job_id: int) -> Subscription | None:
    row = db.execute(_SUBSCRIPTION_SQL, (job_id,)).fetchone()
    return Subscription.from_json(row[0]) if row else None


# -- written with the change ---------------------------------------------------------------------------------

def emit(db: Statements, job_id: int, event_type: str, subscription: Subscription | None = None,
         **data: Any) -> str | None:
    """Write `event_type` for the job (after the change it tells of, in the same transaction) if the job
    subscribed to it; its event id, or None. `data` overrides what the row says (a phase passed on the way)."""
    subscription = subscription or subscription_of(db, job_id)
    if subscription is None or event_type not in subscription.types:
        return None
    now = utcnow()
    event_id = f"msg_{uuid.uuid4().hex}"
    db.execute(_INSERT_SQL, (event_id, job_id, event_type, _body(db, job_id, event_type, now, data), iso_utc(now),
                             iso_utc(now), iso_utc(now + timedelta(seconds=subscription.give_up_s))))
    return event_id


def emit_transition(db: Statements, job_id: int, to: JobState) -> None:
    """The event of a state change: `job.started` for running, the terminal event for an ending."""
    event_type = STARTED if to is JobState.RUNNING else TERMINAL_EVENTS.get(to)
    if event_type is not None:
        emit(db, job_id, event_type)


_NEWEST_SQL = ("SELECT id, type, attempts, state, created_at FROM webhook_events WHERE job_id = ? "
               "ORDER BY id DESC LIMIT 1")
_LAST_PROGRESS_SQL = ("SELECT created_at FROM webhook_events WHERE job_id = ? AND type = 'job.progress' "
                      "ORDER BY id DESC LIMIT 1")
_COALESCE_SQL = "UPDATE webhook_events SET body = ? WHERE id = ? AND attempts = 0 AND state = 'pending'"


def emit_running(db: Statements, job_id: int, *, old_phase: str | None, values: dict[str, Any],
                 subscription: Subscription, entered: Sequence[str] = (),
                 checkpoints: Sequence[dict[str, Any]] = (), samples: Sequence[dict[str, Any]] = ()) -> None:
    """The events of a running job's progress write: `job.phase` for each phase it entered (several when
    their markers came in one read), else when the phase changed; `job.checkpoint` for each step LoRA whose
    verification this write recorded first (`data.checkpoint`); `job.progress` (coalesced, at most one per
    interval) when the step did, last: a progress event written here is the newest, which a later step may
    coalesce into."""
    phase = values.get("phase")
    if entered:
        for name in entered:
            emit(db, job_id, PHASE, subscription, phase=name)
    elif phase is not None and phase != old_phase:
        emit(db, job_id, PHASE, subscription)
    for checkpoint in checkpoints:
        emit(db, job_id, CHECKPOINT, subscription, checkpoint=checkpoint)
    for sample in samples:  # a sample pass over, after its step LoRA's verdict (`job.sample`)
        emit(db, job_id, "job.sample", subscription, sample=sample)
    if "step" in values and PROGRESS in subscription.types:
        _progress(db, job_id, subscription)


def _progress(db: Statements, job_id: int, subscription: Subscription) -> None:
    newest = db.execute(_NEWEST_SQL, (job_id,)).fetchone()
    if newest is not None and newest[1] == PROGRESS and newest[2] == 0 and newest[3] == PENDING:
        # Not tried yet: nobody has seen it, so the newest step takes its place under the same id.
        db.execute(_COALESCE_SQL, (_body(db, job_id, PROGRESS, utcnow()), newest[0]))
        return
    last = db.execute(_LAST_PROGRESS_SQL, (job_id,)).fetchone()
    created = parse_utc(last[0]) if last else None
    if created is not None and (utcnow() - created).total_seconds() < subscription.progress_interval_s:
        return
    emit(db, job_id, PROGRESS, subscription)


def _body(db: Statements, job_id: int, event_type: str, now: datetime, overrides: dict[str, Any] | None = None) -> str:
    row = db.execute(_DATA_SQL, (job_id,)).fetchone()
    data = job_data({**dict(zip(DATA_COLUMNS, row, strict=True)), **(overrides or {})})
    return json.dumps({"type": event_type, "timestamp": iso_utc(now), "data": data}, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)


def job_data(row: dict[str, Any]) -> dict[str, Any]:
    """A job's columns as `GET /train/<id>` names them, with its `retryable` (states.RETRYABLE: whether the same
    request may pass on a new try; null unless failed)."""
    data = {("worker_job_id" if k == "id" else k): v for k, v in row.items()}
    for key in ("loss", "eta_s"):
        value = data.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            data[key] = None  # GET says null for nan; JSON has no NaN
    data["retryable"] = retryable(data.get("status"), data.get("failure_class"))
    return data


# -- the sender's side -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Due:
    """The next event of one job, due now: the sender's unit of work."""

    pk: int
    event_id: str
    job_id: int
    type: str
    body: str
    attempts: int
    give_up_at: datetime


# Per job, only its oldest pending event may go: events of one job arrive in the order they were written.
_DUE_SQL = ("SELECT e.id, e.event_id, e.job_id, e.type, e.body, e.attempts, e.give_up_at FROM webhook_events e "
            "WHERE e.state = 'pending' AND e.next_attempt_at <= ? AND e.id = (SELECT min(o.id) FROM "
            "webhook_events o WHERE o.job_id = e.job_id AND o.state = 'pending') "
            "ORDER BY e.next_attempt_at, e.id LIMIT ?")
_NEXT_DUE_SQL = "SELECT min(next_attempt_at) FROM webhook_events WHERE state = 'pending'"


def due(db: Statements, *, limit: int = 50) -> list[Due]:
    rows = db.execute(_DUE_SQL, (iso_utc(utcnow()), limit)).fetchall()
    return [Due(r[0], r[1], r[2], r[3], r[4], r[5], parse_utc(r[6]) or utcnow()) for r in rows]


def next_due_at(db: Statements) -> datetime | None:
    row = db.execute(_NEXT_DUE_SQL).fetchone()
    return parse_utc(row[0]) if row and row[0] else None


_BEGIN_ATTEMPT_SQL = "INSERT INTO webhook_attempts (event_pk, started_at) VALUES (?, ?)"
_COUNT_ATTEMPT_SQL = "UPDATE webhook_events SET attempts = attempts + 1 WHERE id = ?"


def begin_attempt(db: Statements, event_pk: int) -> int:
    """Record that an attempt starts, before the request leaves: a sender killed during it leaves this row
    open, and the next sender closes it as interrupted and sends the same event again."""
    db.execute(_COUNT_ATTEMPT_SQL, (event_pk,))
    cursor = db.execute(_BEGIN_ATTEMPT_SQL, (event_pk, iso_utc(utcnow())))
    return int(getattr(cursor, "lastrowid", 0) or db.execute("SELECT last_insert_rowid()").fetchone()[0])


_FINISH_ATTEMPT_SQL = ("UPDATE webhook_attempts SET finished_at = ?, status_code = ?, latency_ms = ?, error = ? "
                       "WHERE id = ?")
_DELIVERED_SQL = ("UPDATE webhook_events SET state = 'delivered', delivered_at = ?, last_error = NULL "
                  "WHERE id = ? AND state = 'pending'")
_RETRY_SQL = "UPDATE webhook_events SET next_attempt_at = ?, last_error = ? WHERE id = ? AND state = 'pending'"
_GIVE_UP_SQL = "UPDATE webhook_events SET state = 'given_up', last_error = ? WHERE id = ? AND state = 'pending'"


def finish_attempt(db: Statements, attempt_id: int, *, status_code: int | None, latency_ms: float,
                   error: str | None) -> None:
    db.execute(_FINISH_ATTEMPT_SQL, (iso_utc(utcnow()), status_code, round(latency_ms, 3), error, attempt_id))


def delivered(db: Statements, event_pk: int) -> None:
    db.execute(_DELIVERED_SQL, (iso_utc(utcnow()), event_pk))


def retry_at(db: Statements, event_pk: int, when: datetime, error: str) -> None:
    db.execute(_RETRY_SQL, (iso_utc(when), error, event_pk))


def give_up(db: Statements, event_pk: int, error: str) -> None:
    db.execute(_GIVE_UP_SQL, (error, event_pk))


_INTERRUPTED_SQL = ("UPDATE webhook_attempts SET finished_at = ?, error = 'interrupted: the sender stopped "
                    "during this attempt; the event is sent again under the same id' WHERE finished_at IS NULL")


def close_interrupted(db: Statements) -> int:
    """Attempts a dead sender left open (run only by the sender holding the one sender lock)."""
    return int(db.execute(_INTERRUPTED_SQL, (iso_utc(utcnow()),)).rowcount)


_REDELIVER_SQL = ("UPDATE webhook_events SET state = 'pending', next_attempt_at = ?, give_up_at = ?, "
                  "delivered_at = NULL WHERE job_id = ? AND event_id = ?")


def redeliver(db: Statements, job_id: int, event_id: str, give_up_s: float) -> bool:
    """Send the event again (whatever became of it), under its own id; False if the job has no such event."""
    now = utcnow()
    return db.execute(_REDELIVER_SQL, (iso_utc(now), iso_utc(now + timedelta(seconds=give_up_s)), job_id,
                                       event_id)).rowcount == 1


# -- what an operator and arbo read ----------------------------------------------------------------------------

_EVENTS_SQL = ("SELECT id, event_id, type, state, attempts, created_at, next_attempt_at, delivered_at, last_error "
               "FROM webhook_events WHERE job_id = ? ORDER BY id")
_ATTEMPTS_SQL = ("SELECT a.event_pk, a.started_at, a.finished_at, a.status_code, a.latency_ms, a.error "
                 "FROM webhook_attempts a JOIN webhook_events e ON e.id = a.event_pk WHERE e.job_id = ? "
                 "ORDER BY a.id")


def deliveries(db: Statements, job_id: int) -> list[dict[str, Any]]:
    """Each event of the job with each of its attempts, oldest first."""
    attempts: dict[int, list[dict[str, Any]]] = {}
    for pk, started, finished, code, latency, error in db.execute(_ATTEMPTS_SQL, (job_id,)).fetchall():
        attempts.setdefault(pk, []).append({"at": started, "finished_at": finished, "status_code": code,
                                            "latency_ms": latency, "error": error})
    return [{"event_id": r[1], "type": r[2], "state": _label(r[3], r[4]), "attempts": attempts.get(r[0], []),
             "created_at": r[5], "next_attempt_at": r[6] if r[3] == PENDING else None, "delivered_at": r[7],
             "last_error": r[8]} for r in db.execute(_EVENTS_SQL, (job_id,)).fetchall()]


def _label(state: str, attempts: int) -> str:
    """`retrying` is a pending event that has been tried: what /metrics and the deliveries list say."""
    return "retrying" if state == PENDING and attempts > 0 else state


def bodies(db: Statements, job_id: int) -> Sequence[tuple[str, str]]:
    """(event id, body) of every event of the job, oldest first (tests and the CLI)."""
    return [(r[0], r[1]) for r in db.execute(
        "SELECT event_id, body FROM webhook_events WHERE job_id = ? ORDER BY id", (job_id,)).fetchall()]


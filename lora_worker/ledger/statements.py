"""The job statements both ledger paths issue, each written once, on the Python DB-API alone.

The web and ops reach the ledger through SQLAlchemy (`repository.py`); the supervisor, which runs for hours
next to the trainer, through the stdlib `sqlite3` module (`supervisor.py`), because SQLAlchemy alone is 28 MiB
of its memory and most of its start. Both run the statements here, inside their own BEGIN IMMEDIATE
transaction, on anything with `execute(sql, params)` and `executemany(sql, rows)` (a `sqlite3.Connection`, or
`repository`'s adapter of a Session's connection): the compare-and-set of every state change, the event row it
leaves, the progress write with its loss points, the cancel probe, the history read for the ETA.

A row becomes `failed` through `fail_in` only, so every failure reads the same way whoever wrote it.
Nothing here imports SQLAlchemy: `tests/run/test_imports.py` holds the supervisor to that.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from lora_worker.ledger import outbox
from lora_worker.ledger.checkpoints import CheckpointRow, event_data as checkpoint_data, \
    record_in as record_checkpoints_in
from lora_worker.ledger.samples import SamplePass, record_in as record_samples_in
# The ledger's clock and its text, re-exported: models and callers take them from here.
from lora_worker.ledger.timestamps import iso_utc as iso_utc, parse_utc as parse_utc, utcnow as utcnow
from lora_worker.states import TERMINAL_STATES, TRANSITIONS, FailureClass, JobState


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> Sequence[Any]: ...


class Statements(Protocol):
    """One connection inside the caller's transaction."""

    def execute(self, sql: str, params: Sequence[Any] = ...) -> Cursor: ...

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Cursor: ...


# Stored as JSON text (models.Job's JSON type).
JSON_COLUMNS = frozenset({"argv", "env", "trainer_versions", "sample_prompts"})
# Written by the statements themselves: a caller's value for one would be a second, conflicting write.
MANAGED_COLUMNS = frozenset({"id", "status", "updated_at", "version"})
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")


# -- values as this schema stores them ------------------------------------------------------------------------

def bind(value: Any) -> Any:
    """A Python value as the driver stores it here: timestamps as ISO text, JSON columns' lists and dicts as JSON."""
    if isinstance(value, datetime):
        return iso_utc(value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return value


def _checked(columns: Iterable[str]) -> tuple[str, ...]:
    """The names, sorted, once each is a plain identifier a caller may write (SQLite itself refuses a name
    that is no column of jobs: "no such column")."""
    columns = tuple(sorted(columns))
    refused = [c for c in columns if not _IDENTIFIER.fullmatch(c) or c in MANAGED_COLUMNS]
    if refused:
        raise ValueError(f"not columns of jobs a caller may write: {refused}")
    return columns


# -- state changes ---------------------------------------------------------------------------------------------

STATUS_SQL = "SELECT status FROM jobs WHERE id = ?"
EVENT_SQL = ("INSERT INTO job_events (job_id, at, from_status, to_status, actor, reason) "
             "VALUES (?, ?, ?, ?, ?, ?)")
_TRANSITION_SQL: dict[tuple[str, ...], str] = {}


def record_event(db: Statements, job_id: int, frm: JobState | None, to: JobState, actor: str,
                 reason: str | None) -> None:
    db.execute(EVENT_SQL, (job_id, iso_utc(utcnow()), frm.value if frm else None, to.value, actor, reason))


def transition_in(db: Statements, job_id: int, to: JobState, *, actor: str, reason: str | None = None,
                  **values: Any) -> bool:
    """Move a job to `to` if its current state allows it, with `values` in the same UPDATE; False (and no
    write) if it does not. A compare-and-set on the state read, so a late writer loses instead of overwriting.

    How a cancelled job ends is its run's to decide (states.CANCEL_RULE): a trainer still running when the cancel
    reached it is stopped and the job written `cancelled`; one that had ended keeps the outcome it had."""
    row = db.execute(STATUS_SQL, (job_id,)).fetchone()
    if row is None or to not in TRANSITIONS[JobState(row[0])]:
        return False
    current = JobState(row[0])
    if to in TERMINAL_STATES:
        values.setdefault("finished_at", utcnow())
        # Nothing is left to wait for: no writer of a terminal state (reconcile's included) leaves an ETA behind.
        values.setdefault("eta_s", None)
        values.setdefault("eta_basis", None)
    columns = _checked(values)
    sql = _TRANSITION_SQL.get(columns)
    if sql is None:
        assignments = "".join(f"{c} = ?, " for c in columns)
        sql = _TRANSITION_SQL[columns] = (f"UPDATE jobs SET status = ?, {assignments}updated_at = ?, "
                                          "version = version + 1 WHERE id = ? AND status = ?")
    params = (to.value, *(bind(values[c]) for c in columns), iso_utc(utcnow()), job_id, current.value)
    if db.execute(sql, params).rowcount != 1:
        return False
    record_event(db, job_id, current, to, actor, reason)
    outbox.emit_transition(db, job_id, to)  # the webhook event commits with the change, or neither does
    return True


FAILURE_TAIL_LINES = 25  # the log lines a failure quotes: enough for a Python traceback's end
FAILURE_MAX_CHARS = 4000  # the whole `error` text, sentence included
SENTENCE_MAX_CHARS = 2000  # a sentence quoting a long line is cut, so the log lines keep their room


def fail_in(db: Statements, job_id: int, *, actor: str, failure_class: FailureClass, sentence: str,
            log_lines: Sequence[str] = (), **values: Any) -> bool:
    """Move a job to `failed`, the one statement that does: False (and no write) if its state does not allow it.

    The row gets `failure_class`, and `error = failure_text(sentence, log_lines)`; the job's event gets the
    sentence as its reason. `values` are other columns to write in the same UPDATE (exit status…).
    """
    text = failure_text(sentence, log_lines)
    return transition_in(db, job_id, JobState.FAILED, actor=actor, reason=text.split("\n", 1)[0],
                         failure_class=failure_class.value, error=text, **values)


def failure_text(sentence: str, log_lines: Sequence[str] = ()) -> str:
    """The `error` of every failed row, in one shape:

        <one sentence, on one line, as the caller wrote it, `.` last (unless it ends in . ! ?)>
        <an empty line>
        <the log's last non-blank lines, right-stripped, at most FAILURE_TAIL_LINES>

    With no log lines it is the sentence alone. The sentence is at most SENTENCE_MAX_CHARS, the whole at most
    FAILURE_MAX_CHARS: when the lines are too long their beginning is cut, marked `…`, because the end of a
    log is what explains a failure. The first line is always the sentence (`v_failures` shows it as the
    summary), and `sentence, _, lines = error.partition("\n\n")` takes the two apart.
    """
    # Never re-cased: a sentence may begin with the trainer's own line, quoted as it was written.
    text = " ".join(sentence.split()) or "The job failed"
    if len(text) > SENTENCE_MAX_CHARS:
        text = text[:SENTENCE_MAX_CHARS - 2] + "…"
    if text[-1] not in ".!?":
        text += "."
    tail = "\n".join([line.rstrip() for line in log_lines if line.strip()][-FAILURE_TAIL_LINES:])
    if not tail:
        return text
    room = FAILURE_MAX_CHARS - len(text) - 2
    return text + "\n\n" + (tail if len(tail) <= room else "…" + tail[len(tail) - room + 1:])


# -- while it runs ---------------------------------------------------------------------------------------------

# A step seen again (its second redraw carries the new loss, the bar's close repeats it) updates the loss and
# keeps the time the step was first written: that time is when the step happened.
PROGRESS_POINT_SQL = ("INSERT INTO job_progress (job_id, step, loss, at) VALUES (?, ?, ?, ?) "
                      "ON CONFLICT (job_id, step) DO UPDATE SET loss = excluded.loss")
_RUNNING_UPDATE_SQL: dict[tuple[str, ...], str] = {}
_EVENTS_BEFORE_SQL = "SELECT webhook_events, phase FROM jobs WHERE id = ?"


PHASES_RECORDED_SQL = ("SELECT count(*) FROM job_events WHERE job_id = ? AND from_status = 'running' "
                       "AND to_status = 'running' AND reason LIKE 'phase %'")


def update_running_in(db: Statements, job_id: int, points: Iterable[tuple[int, float | None, datetime]] = (),
                      phases: Sequence[Any] = (), actor: str = "supervisor",
                      checkpoints: Iterable[CheckpointRow] = (), samples: Iterable[SamplePass] = (),
                      **values: Any) -> bool:
    """Write progress (or identity) of a running job and its new loss points; False once it is not running.

    `phases` are all the phases the run has entered, in order (the parser's `Progress.phases`): those past
    the ones already recorded become events (running → running, "phase <name>"). A write that failed, or a
    Slurm poller that re-read the log from its start, records none twice and misses none. `checkpoints`: the
    step LoRAs and states seen (ledger/checkpoints.py), in the same transaction; a step LoRA's first recorded
    verification is its `job.checkpoint` event (so again: none twice); `samples`: the sample passes over (ledger/
    samples.py), a pass's first write its `job.sample` event."""
    columns = _checked(values)
    sql = _RUNNING_UPDATE_SQL.get(columns)
    if sql is None:
        assignments = "".join(f"{c} = ?, " for c in columns)
        sql = _RUNNING_UPDATE_SQL[columns] = (f"UPDATE jobs SET {assignments}updated_at = ?, version = version + 1 "
                                              f"WHERE id = ? AND status = '{JobState.RUNNING.value}'")
    checkpoints, samples = list(checkpoints), list(samples)
    # the job's subscription and old phase are read first
    wanted = _may_make_events(phases, values, checkpoints) or bool(samples)
    before = db.execute(_EVENTS_BEFORE_SQL, (job_id,)).fetchone() if wanted else None
    if db.execute(sql, (*(bind(values[c]) for c in columns), iso_utc(utcnow()), job_id)).rowcount != 1:
        return False
    rows = [(job_id, step, loss, iso_utc(at)) for step, loss, at in points]
    if rows:
        db.executemany(PROGRESS_POINT_SQL, rows)
    verified = record_checkpoints_in(db, job_id, checkpoints)  # the step LoRAs verified for the first time
    passes = record_samples_in(db, job_id, samples)  # the sample passes written for the first time
    entered = _record_phases(db, job_id, phases, actor)
    if before is not None and (subscription := outbox.Subscription.from_json(before[0])) is not None:
        outbox.emit_running(db, job_id, old_phase=before[1], values=values, subscription=subscription,
                            entered=entered, checkpoints=[checkpoint_data(c) for c in verified], samples=passes)
    return True


def _may_make_events(phases: Sequence[Any], values: dict[str, Any], checkpoints: Sequence[CheckpointRow]) -> bool:
    """Only a step, a phase or a step LoRA's verification makes a webhook event."""
    return bool(phases or {"step", "phase"} & values.keys() or any(c.verified is not None for c in checkpoints))


def _record_phases(db: Statements, job_id: int, phases: Sequence[Any], actor: str) -> list[str]:
    """The phases past those already recorded, each an event (running → running, "phase <name>"); their names."""
    entered: list[str] = []
    if phases and (recorded := db.execute(PHASES_RECORDED_SQL, (job_id,)).fetchone()[0]) < len(phases):
        for phase in phases[recorded:]:  # a few per run: one event each, as every other event is written
            entered.append(name := str(getattr(phase, "value", phase)))
            record_event(db, job_id, JobState.RUNNING, JobState.RUNNING, actor, f"phase {name}")
    return entered


CANCEL_STATE_SQL = "SELECT status, cancel_requested_at IS NOT NULL FROM jobs WHERE id = ?"


def cancel_state_in(db: Statements, job_id: int) -> tuple[str | None, bool]:
    """(status, whether a cancel is requested): the supervisor's twice-a-second probe, kept cheap."""
    row = db.execute(CANCEL_STATE_SQL, (job_id,)).fetchone()
    return (row[0], bool(row[1])) if row else (None, False)


# The last step's time is its loss-curve point's, which keeps the time the step was first written. `?3 IS NULL`:
# any card (a backend whose scheduler picks the GPU).
SAVE_AND_TEARDOWN_SQL = (
    "SELECT (julianday(finished_at) - julianday((SELECT max(p.at) FROM job_progress AS p "
    "WHERE p.job_id = jobs.id))) * 86400.0 FROM jobs "
    f"WHERE status = '{JobState.SUCCEEDED.value}' AND backend = ?1 AND tier = ?2 AND (?3 IS NULL OR device_index = ?3) "
    "AND finished_at IS NOT NULL ORDER BY id DESC LIMIT ?4")


def save_and_teardown_in(db: Statements, *, backend: str, tier: str, device_index: int | None,
                         limit: int = 25) -> list[float]:
    """Seconds from the last step to the end (the LoRA saved, the trainer torn down, the file verified) of the
    latest succeeded jobs of this backend, tier and card (None: any): the part of a run no step rate predicts."""
    rows = db.execute(SAVE_AND_TEARDOWN_SQL, (backend, tier, device_index, limit)).fetchall()
    return [max(0.0, float(v)) for (v,) in rows if v is not None]


# -- what SQLite's errors mean ---------------------------------------------------------------------------------

BUSY = ("database is locked", "database is busy", "database table is locked")
UNWRITABLE = ("database or disk is full", "disk i/o error", "attempt to write a readonly database")


def is_busy(exc: BaseException) -> bool:
    """Whether an error is SQLite saying another connection holds the lock past the busy timeout."""
    text = str(getattr(exc, "orig", exc)).lower()
    return any(marker in text for marker in BUSY)


def is_unwritable(exc: BaseException) -> bool:
    """Whether an error is the file system refusing the write (full disk, I/O error, read-only)."""
    text = str(getattr(exc, "orig", exc)).lower()
    return any(marker in text for marker in UNWRITABLE)


# -- the file it was -------------------------------------------------------------------------------------------

def file_identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the ledger file, None if there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def replaced(path: Path, first: tuple[int, int] | None, now: tuple[int, int] | None) -> str | None:
    """Why the file at `path` (identity `now`) is not the ledger first opened (`first`), or None."""
    if now is None:
        return f"the ledger file {path} was deleted while the service ran; restart the service"
    if first is not None and now != first:
        return (f"the ledger file {path} was replaced while the service ran (inode {first[1]} "
                f"became {now[1]}); restart the service")
    return None

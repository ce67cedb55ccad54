"""The supervisor's ledger: its few statements (`statements.py`) on one stdlib `sqlite3` connection.

The supervisor runs for hours next to the trainer and must start it fast, so it loads no SQLAlchemy (Core and
ORM: 28 MiB and ~160 ms of its start). The rules stay those of `db.py`: WAL, the busy timeout, foreign keys,
every write in one BEGIN IMMEDIATE transaction, the file checked to be the ledger first opened before each
transaction (LedgerReplaced otherwise), and SQLite's busy and full errors raised as LedgerBusy and
LedgerUnwritable, which the supervisor waits out (transcript/persist.py). The same triggers keep `job_counts`.

The job is read as a `JobRecord`, a frozen copy of the columns the supervisor uses; the state changes it may
make are named methods (queued → running, then succeeded, cancelled, or `fail_job`), not a general transition.
"""
from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from lora_worker.errors import LedgerBusy, LedgerReplaced, LedgerUnwritable
from lora_worker.ledger import statements as sql
from lora_worker.states import FailureClass, JobState, Phase

Synchronous = Literal["FULL", "NORMAL"]


@dataclass(frozen=True)
class JobRecord:
    """The columns of one job the supervisor uses, as read once when it starts (the request, as dispatch
    checked and recorded it: nothing of it changes while the job is queued or running)."""

    id: int
    status: str
    tier: str
    device_index: int
    total_steps: int
    estimated_duration_s: float | None
    argv: list[str]
    env: dict[str, str]
    dataset_dir: str
    base_model_path: str
    output_dir: str
    output_name: str
    trigger: str
    subject_class: str
    repeats: int
    seed: int
    lora_file: str
    lora_rank: int
    lora_steps: int
    lora_dtype: str
    dataset_dev_ino: str | None
    kohya_dev_ino: str | None
    output_dev_ino: str | None
    sd_scripts_commit: str | None
    resume_step: int = 0  # a resume's first step (migration 0014): its steps bar counts from there
    image_count: int | None = None  # the dataset config's repeats follow from it (host/dataset_config.py)
    backend: str = "local"  # where it runs (the column's own default: rows before migration 0009 are local)
    sample_prompts: list[dict[str, Any]] | None = None  # the job's sample prompts (migration 0017)


RECORD_COLUMNS = tuple(f.name for f in fields(JobRecord))
FIND_JOB_SQL = f"SELECT {', '.join(RECORD_COLUMNS)} FROM jobs WHERE id = ?"


def _record(row: tuple[Any, ...]) -> JobRecord:
    values = dict(zip(RECORD_COLUMNS, row))
    for column in sql.JSON_COLUMNS & values.keys():
        values[column] = json.loads(values[column]) if values[column] is not None else None
    return JobRecord(**values)


class SupervisorLedger:
    """One job's ledger as its supervisor writes it. `connection_class` is sqlite3's (a test's subclass fails
    statements where SQLite would)."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 5.0, synchronous: Synchronous = "FULL",
                 connection_class: type[sqlite3.Connection] = sqlite3.Connection) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.synchronous = synchronous
        self.connection_class = connection_class
        self.identity = sql.file_identity(path)  # of the file first seen; None until SQLite creates it
        self._conn: sqlite3.Connection | None = None

    # -- the supervisor's statements ---------------------------------------------------------------------

    def find_job(self, job_id: int) -> JobRecord | None:
        with self._read() as conn:
            row = conn.execute(FIND_JOB_SQL, (job_id,)).fetchone()
        return _record(row) if row is not None else None

    def mark_running(self, job_id: int, **values: Any) -> bool:
        """queued → running, with who runs it (`values`); False if the job left the queue meanwhile."""
        with self._write() as conn:
            return sql.transition_in(conn, job_id, JobState.RUNNING, actor="supervisor", reason="supervisor started",
                                     **values)

    def update_running(self, job_id: int, *, points: Iterable[tuple[int, float | None, datetime]] = (),
                       phases: Sequence[Phase] = (), **values: Any) -> bool:
        with self._write() as conn:
            return sql.update_running_in(conn, job_id, points, phases, **values)

    def cancel_state(self, job_id: int) -> tuple[str | None, bool]:
        with self._read() as conn:
            return sql.cancel_state_in(conn, job_id)

    def save_and_teardown_durations(self, *, backend: str, tier: str, device_index: int | None) -> list[float]:
        with self._read() as conn:
            return sql.save_and_teardown_in(conn, backend=backend, tier=tier, device_index=device_index)

    def mark_succeeded(self, job_id: int, *, reason: str, **values: Any) -> bool:
        with self._write() as conn:
            return sql.transition_in(conn, job_id, JobState.SUCCEEDED, actor="supervisor", reason=reason, **values)

    def mark_cancelled(self, job_id: int, *, reason: str, **values: Any) -> bool:
        with self._write() as conn:
            return sql.transition_in(conn, job_id, JobState.CANCELLED, actor="supervisor", reason=reason, **values)

    def fail_job(self, job_id: int, *, failure_class: FailureClass, sentence: str, log_lines: Iterable[str] = (),
                 **values: Any) -> bool:
        """The supervisor's failed row: the same statement, and the same text, as `repository.fail_job`'s."""
        with self._write() as conn:
            return sql.fail_in(conn, job_id, actor="supervisor", failure_class=failure_class, sentence=sentence,
                               log_lines=tuple(log_lines), **values)

    def note(self, job_id: int, reason: str) -> None:
        """An event of a running job that changes no state (running → running), e.g. a file moved aside."""
        with self._write() as conn:
            sql.record_event(conn, job_id, JobState.RUNNING, JobState.RUNNING, "supervisor", reason)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- transactions ------------------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One BEGIN IMMEDIATE transaction: committed if the block returns, rolled back if it raises."""
        with _sorted_errors():
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    with suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One statement in SQLite's own read transaction: under WAL it never waits for a writer."""
        with _sorted_errors():
            yield self._connection()

    def _connection(self) -> sqlite3.Connection:
        # Before every transaction, as db.Database does: never carry on into an unlinked or a stranger's file.
        now = sql.file_identity(self.path)
        if (problem := sql.replaced(self.path, self.identity, now)) is not None:
            raise LedgerReplaced(problem[0].upper() + problem[1:] + ".")
        if self._conn is None:
            # Opened on first use, inside the error sorting: a ledger busy at the first PRAGMA is waited out.
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                   factory=self.connection_class)
            try:
                for pragma in ("journal_mode=WAL", f"synchronous={self.synchronous}",
                               f"busy_timeout={int(self.busy_timeout_s * 1000)}", "foreign_keys=ON"):
                    conn.execute(f"PRAGMA {pragma}")
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            self.identity = self.identity or now
        return self._conn


@contextmanager
def _sorted_errors() -> Iterator[None]:
    # Both are conditions of the host, not bugs: the supervisor waits them out.
    try:
        yield
    except sqlite3.OperationalError as exc:
        if sql.is_busy(exc):
            raise LedgerBusy() from exc
        if sql.is_unwritable(exc):
            raise LedgerUnwritable(f"The job ledger cannot be written: {exc}.") from exc
        raise

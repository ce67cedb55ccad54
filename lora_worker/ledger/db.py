"""The SQLite engine, configured in one place: WAL, busy timeout, foreign keys, and BEGIN IMMEDIATE to write.

Two engines share the file. Writers begin with BEGIN IMMEDIATE: a deferred transaction that reads and then
writes fails at once with "database is locked" when another process committed in between, whatever the busy
timeout. Readers begin with a plain BEGIN, so under WAL they never wait for the supervisor's progress writes.

The ledger is the file it was when it was opened: every transaction first compares the path's (device, inode)
with the one the Database first saw (one stat, ~1 µs). A ledger deleted or replaced under a running service
(a restore by `mv`, an operator's `rm`) makes every read and write fail loudly (LedgerReplaced, a 503) and
/healthz say so, instead of carrying on into an unlinked inode or a stranger's file. Restart to reopen.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import sqlalchemy.exc
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session, sessionmaker

from lora_worker.errors import LedgerBusy, LedgerReplaced, LedgerUnwritable
from lora_worker.ledger.statements import file_identity, is_busy, is_unwritable, replaced

Synchronous = Literal["FULL", "NORMAL"]


def make_engine(path: Path, *, busy_timeout_s: float = 5.0, synchronous: Synchronous = "FULL",
                immediate: bool = True) -> Engine:
    """An engine on `path` whose every transaction begins IMMEDIATE (writers) or DEFERRED (readers)."""
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": busy_timeout_s})
    busy_ms = int(busy_timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        # Take transaction control away from pysqlite (SQLAlchemy's documented recipe), so the
        # "begin" hook below decides how every transaction starts.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        for pragma in ("journal_mode=WAL", f"synchronous={synchronous}", f"busy_timeout={busy_ms}",
                       "foreign_keys=ON"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # type: ignore[no-untyped-def]
        conn.exec_driver_sql(begin)

    return engine


@dataclass
class Database:
    """The ledger file: a writing engine and a reading engine, and short sessions on each."""

    path: Path
    writer: Engine
    reader: Engine
    identity: tuple[int, int] | None = field(default=None)  # (st_dev, st_ino) of the file first opened

    @classmethod
    def open(cls, path: Path, *, busy_timeout_s: float = 5.0, synchronous: Synchronous = "FULL") -> Database:
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(
            path=path,
            writer=make_engine(path, busy_timeout_s=busy_timeout_s, synchronous=synchronous, immediate=True),
            reader=make_engine(path, busy_timeout_s=busy_timeout_s, synchronous=synchronous, immediate=False),
        )

    def __post_init__(self) -> None:
        self._writing = sessionmaker(self.writer, expire_on_commit=False)
        self._reading = sessionmaker(self.reader, expire_on_commit=False)
        if self.identity is None:
            self.identity = file_identity(self.path)  # None until SQLite creates the file on first connect
        for engine in (self.writer, self.reader):
            # Before BEGIN, so a refused transaction never starts.
            event.listen(engine, "begin", self._refuse_if_replaced, insert=True)

    def identity_problem(self) -> str | None:
        """Why the file at the ledger path is not the ledger this Database opened, or None."""
        now = file_identity(self.path)
        problem = replaced(self.path, self.identity, now)
        if problem is None and self.identity is None:
            self.identity = now
        return problem

    def _refuse_if_replaced(self, _conn: Connection) -> None:
        problem = self.identity_problem()
        if problem is not None:
            raise LedgerReplaced(problem[0].upper() + problem[1:] + ".")

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that may write; commits on success, rolls back on error."""
        with _busy_as_unavailable(), self._writing.begin() as session:
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only snapshot, rolled back on close; never takes the write lock."""
        with _busy_as_unavailable(), self._reading() as session:
            yield session

    @contextmanager
    def write_connection(self) -> Iterator[Connection]:
        """A Core connection in a BEGIN IMMEDIATE transaction, for hot paths that skip the ORM."""
        with _busy_as_unavailable(), self.writer.begin() as conn:
            yield conn

    @contextmanager
    def read_connection(self) -> Iterator[Connection]:
        """A Core connection for a read-only hot path; its transaction is rolled back on close."""
        with _busy_as_unavailable(), self.reader.connect() as conn:
            yield conn

    @contextmanager
    def writing(self) -> Iterator[Driver]:
        """`write_connection` as the DB-API statements (statements.py, outbox.py) speak to it."""
        with self.write_connection() as conn:
            yield Driver(conn)

    @contextmanager
    def reading(self) -> Iterator[Driver]:
        with self.read_connection() as conn:
            yield Driver(conn)

    def dispose(self) -> None:
        self.writer.dispose()
        self.reader.dispose()


class Driver:
    """A SQLAlchemy connection as `statements.py` speaks to it: the DB-API's qmark SQL, straight to the
    driver, in the connection's transaction (a tenth of the ORM's CPU on the hot paths; bench/stream.py)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def execute(self, statement: str, params: Sequence[Any] = ()) -> CursorResult[Any]:
        return self.conn.exec_driver_sql(statement, tuple(params))

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]]) -> CursorResult[Any]:
        return self.conn.exec_driver_sql(statement, [tuple(r) for r in rows])


@contextmanager
def _busy_as_unavailable() -> Iterator[None]:
    # Both are conditions of the host, not bugs: the client gets a 503 it may retry, never a 500.
    try:
        yield
    except sqlalchemy.exc.OperationalError as exc:
        if is_busy(exc):
            raise LedgerBusy() from exc
        if is_unwritable(exc):
            raise LedgerUnwritable(f"The job ledger cannot be written: {getattr(exc, 'orig', exc)}.") from exc
        raise

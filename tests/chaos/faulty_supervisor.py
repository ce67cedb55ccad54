"""The real supervisor, with its ledger failing every write while a flag file exists, or once.

The failure is raised where SQLAlchemy would raise a real SQLite error (an OperationalError around sqlite3's
"database or disk is full", or "database is locked"), so the supervisor meets exactly what a full disk or
another writer gives it.
Usage: python -m tests.chaos.faulty_supervisor <job_id>, with in the environment FAULT_FLAG=<path> (every
write fails while it exists) and optionally FAULT_ONCE=<text> (the first write whose SQL holds it is locked).
"""
from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path

import sqlalchemy.exc
from sqlalchemy import event

import lora_worker.ledger.db as db_module

FLAG = Path(os.environ["FAULT_FLAG"])
ONCE = [os.environ["FAULT_ONCE"]] if os.environ.get("FAULT_ONCE") else []
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")
_make_engine = db_module.make_engine


def faulty_make_engine(*args, **kwargs):  # type: ignore[no-untyped-def]
    engine = _make_engine(*args, **kwargs)

    @event.listens_for(engine, "before_cursor_execute")
    def _full(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().split(None, 1)[0].upper() not in WRITES:
            return
        if FLAG.exists():
            raise sqlalchemy.exc.OperationalError(statement, params,
                                                  sqlite3.OperationalError("database or disk is full"))
        if ONCE and ONCE[0] in statement:
            ONCE.clear()
            raise sqlalchemy.exc.OperationalError(statement, params, sqlite3.OperationalError("database is locked"))

    return engine


db_module.make_engine = faulty_make_engine

from lora_worker.run.__main__ import main  # noqa: E402 - after the patch, on purpose

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The real supervisor, with its ledger failing every write while a flag file exists.

The failure is raised where SQLAlchemy would raise a real SQLITE_FULL (an OperationalError around
sqlite3's "database or disk is full"), so the supervisor meets exactly what a full disk gives it.
Usage: python -m tests.chaos.faulty_supervisor <job_id>, with FAULT_FLAG=<path> in the environment.
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
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")
_make_engine = db_module.make_engine


def faulty_make_engine(*args, **kwargs):  # type: ignore[no-untyped-def]
    engine = _make_engine(*args, **kwargs)

    @event.listens_for(engine, "before_cursor_execute")
    def _full(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if FLAG.exists() and statement.lstrip().split(None, 1)[0].upper() in WRITES:
            raise sqlalchemy.exc.OperationalError(statement, params,
                                                  sqlite3.OperationalError("database or disk is full"))

    return engine


db_module.make_engine = faulty_make_engine

from lora_worker.supervisor.__main__ import main  # noqa: E402 - after the patch, on purpose

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

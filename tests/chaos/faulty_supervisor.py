"""The real supervisor, with its ledger failing every write while a flag file exists, or once.

The failure is raised where sqlite3 would raise a real SQLite error (an OperationalError "database or disk is
full", or "database is locked"), on the supervisor's own connection (ledger/supervisor.py), so the supervisor
meets exactly what a full disk or another writer gives it.
Usage: python -m tests.chaos.faulty_supervisor <job_id>, with in the environment FAULT_FLAG=<path> (every
write fails while it exists) and optionally FAULT_ONCE=<text> (the first write whose SQL holds it is locked).
"""
from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path

from lora_worker.ledger import supervisor

FLAG = Path(os.environ["FAULT_FLAG"])
ONCE = [os.environ["FAULT_ONCE"]] if os.environ.get("FAULT_ONCE") else []
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


def _fault(statement: str) -> None:
    if statement.lstrip().split(None, 1)[0].upper() not in WRITES:
        return
    if FLAG.exists():
        raise sqlite3.OperationalError("database or disk is full")
    if ONCE and ONCE[0] in statement:
        ONCE.clear()
        raise sqlite3.OperationalError("database is locked")


class FaultyConnection(sqlite3.Connection):
    def execute(self, statement, params=()):  # type: ignore[no-untyped-def, override]
        _fault(statement)
        return super().execute(statement, params)

    def executemany(self, statement, rows):  # type: ignore[no-untyped-def, override]
        _fault(statement)
        return super().executemany(statement, rows)


_init = supervisor.SupervisorLedger.__init__


def _faulty_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    _init(self, *args, **kwargs)
    self.connection_class = FaultyConnection


supervisor.SupervisorLedger.__init__ = _faulty_init  # type: ignore[method-assign]

from lora_worker.run.__main__ import main  # noqa: E402 - after the patch, on purpose

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

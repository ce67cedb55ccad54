"""What the supervisor waits out and what it gives up on when the ledger refuses a write."""
from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy.exc

from lora_worker.errors import LedgerBusy, LedgerUnwritable
from lora_worker.transcript.persist import persist


def failing(errors: list[BaseException], result: str = "written"):
    def write() -> str:
        if errors:
            raise errors.pop(0)
        return result
    return write


def test_a_busy_or_full_ledger_is_retried_until_it_takes_the_write():
    errors: list[BaseException] = [LedgerBusy(), LedgerUnwritable("disk full"), LedgerBusy()]
    slept: list[float] = []
    assert persist(failing(errors), "test", slept.append) == "written"
    assert errors == [] and slept == [0.1, 0.2, 0.4]  # backing off between tries


@pytest.mark.parametrize("message", ["unable to open database file", "no such table: jobs"])
def test_any_other_ledger_error_is_raised_not_retried_forever(message):
    # Retrying these would hold the job lock for ever and keep the row "running"; raising lets the
    # supervisor exit, and reconcile settles the row.
    error = sqlalchemy.exc.OperationalError("UPDATE jobs", {}, sqlite3.OperationalError(message))
    errors: list[BaseException] = [error]
    with pytest.raises(sqlalchemy.exc.OperationalError):
        persist(failing(errors), "test", lambda s: None)

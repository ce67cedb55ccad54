"""Ledger calls the supervisor waits out: a locked, full or failing ledger is retried, never fatal to the run.

Any other error (the file gone, the schema missing) is not waited on: the supervisor gives up its lock, and
reconcile settles the row instead of a retry loop holding it "running".
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from lora_worker.errors import LedgerBusy, LedgerUnwritable

log = logging.getLogger(__name__)

# What a locked, full or failing ledger raises (lora_worker.ledger.db sorts SQLite's errors).
TRANSIENT = (LedgerBusy, LedgerUnwritable)
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 5.0
T = TypeVar("T")


def persist(write: Callable[[], T], what: str, sleep: Callable[[float], None]) -> T:
    """Run a ledger call until the ledger takes it: a locked or full database is waited out, not fatal.
    Meanwhile the job lock stays held, so reconcile never takes the job for dead."""
    delay = FIRST_DELAY_S
    while True:
        try:
            return write()
        except TRANSIENT as exc:
            log.warning("%s: ledger unavailable (%s); retrying in %.1fs", what, exc, delay)
            sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)


def until_done(step: Callable[[], T | None], sleep: Callable[[float], None]) -> T:
    """Call `step` until it is done (anything but None; None: the ledger refused it and `step` said why), with
    `persist`'s pauses in between."""
    delay = FIRST_DELAY_S
    while (done := step()) is None:
        sleep(delay)
        delay = min(delay * 2, MAX_DELAY_S)
    return done

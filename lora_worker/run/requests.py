"""Reasons to stop that come from outside the trainer, as facts for the follower (transcript/follower.py): a
cancel or a lost row in the ledger, and SIGTERM, SIGINT or SIGHUP to the supervisor itself, noted by the handler
and passed on by the loop. A signal is no client's cancel: the job ends `failed`, `supervisor_signalled`, naming
it (transcript/outcome.py).

The ledger is looked at twice a second, and at once after a wake-up: the web's cancel signals the supervisor
(run/local.py `wake_supervisor`) right after it flagged the row. The poll stays: a wake-up can be lost (a
signal blocked, an ops tool that flags the row without one), and a row ended elsewhere sends none."""
from __future__ import annotations

import logging
import signal

from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.transcript.persist import TRANSIENT
from lora_worker.states import JobState

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5


class StopRequests:
    def __init__(self, db: SupervisorLedger, job_id: int) -> None:
        self.db = db
        self.job_id = job_id
        self.signalled: int | None = None
        self.cancel = False  # a client's cancel is flagged on the row
        self.lost = False  # the row is no longer `running`
        self.last_poll = 0.0
        self.woken = False  # a wake-up came: look at the ledger on the next check, whatever the poll's time

    def on_signal(self, signum: int) -> None:
        self.signalled = signum  # passed on by the loop, never acted on in the handler

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.signalled).name if self.signalled is not None else None

    def wake(self) -> None:
        self.woken = True

    def check(self, now: float) -> None:
        if self.woken or now - self.last_poll >= CANCEL_POLL_S:
            self.woken = False
            self.last_poll = now
            self._poll_ledger()

    def _poll_ledger(self) -> None:
        try:
            status, cancel = self.db.cancel_state(self.job_id)
        except TRANSIENT as exc:
            log.warning("job %s: cannot read the ledger (%s); will retry", self.job_id, exc)
            return
        self.lost = self.lost or status != JobState.RUNNING.value
        self.cancel = self.cancel or cancel

"""Stopping the trainer: SIGTERM to its group, a grace, then SIGKILL to whatever of the job is left.

The stop is a small state machine, NONE → TERM_SENT → KILL_SENT, entered once, for one reason. A later
reason (a cancel after a stall) changes nothing: the first one decides the outcome.
"""
from __future__ import annotations

import logging
import signal
from enum import Enum

from lora_worker.transcript.output import TrainerOutput
from lora_worker.run.seam import RunHost, Trainer

log = logging.getLogger(__name__)

PATIENT_S = 30.0  # how long processes that outlive SIGKILL are polled quickly before the loop slows down
WARN_EVERY_S = 300.0


class StopReason(Enum):
    CANCEL = "cancel"  # a client asked: the only reason a job ends `cancelled`
    # The supervisor itself got SIGTERM, SIGINT or SIGHUP: systemd stopping the unit (its final sweep at a reboot,
    # `systemctl kill`), an operator. Nobody asked for a cancel: the job fails, `supervisor_signalled`.
    SIGNAL = "signal"
    NAN_LOSS = "nan_loss"  # the loss became NaN: nothing more can be learned
    STALL = "stall"  # the watchdog saw no progress within the phase's limit
    LOST = "lost"  # the row is no longer `running`: someone else ended the job
    ORPHANED = "orphaned"  # the launcher was killed and left its trainer running


class StopState(Enum):
    NONE = "none"
    TERM_SENT = "term_sent"  # SIGTERM to the group and the descendants; SIGKILL due at `deadline`
    KILL_SENT = "kill_sent"


class Stopper:
    """Stops one job's processes: the group catches the launcher, the trainer and its workers; the
    descendants catch a grandchild that started its own session (we are their subreaper)."""

    def __init__(self, host: RunHost, output: TrainerOutput, grace_s: float, job_id: int) -> None:
        self.host = host
        self.output = output
        self.grace_s = grace_s
        self.job_id = job_id
        self.state = StopState.NONE
        self.reason: StopReason | None = None
        self.deadline: float | None = None

    def begin(self, trainer: Trainer, reason: StopReason, why: str) -> None:
        """SIGTERM, unless a stop began already or the trainer ended on its own (its outcome stands)."""
        if self.state is not StopState.NONE:
            return
        if trainer.poll() is not None and not self.host.group_members(trainer.pid):
            return
        self.state, self.reason = StopState.TERM_SENT, reason
        self.output.note(f"{why}; SIGTERM to process group {trainer.pid}")
        log.info("job %s: %s; stopping the trainer", self.job_id, why)
        self.kill_everything(trainer.pid, signal.SIGTERM)
        self.deadline = self.host.monotonic() + self.grace_s

    def tick(self, trainer: Trainer, now: float) -> None:
        """SIGKILL once the grace after SIGTERM is over."""
        if self.state is StopState.TERM_SENT and self.deadline is not None and now >= self.deadline:
            self.output.note(f"grace of {self.grace_s:g}s over; SIGKILL to the job's processes")
            self.kill_everything(trainer.pid, signal.SIGKILL)
            self.state = StopState.KILL_SENT

    def kill_everything(self, pgid: int, sig: int) -> None:
        self.host.signal_group(pgid, sig)
        self.host.signal_descendants(sig)

    def ensure_gone(self, pgid: int) -> None:
        """Return only when no process of the job is alive. A process that outlives SIGKILL (stuck in the
        driver, state D) still holds the GPU: the job stays active and the GPU lock held until it goes,
        rather than the ledger saying "every process is gone" while one is not."""
        patient_until = warn_at = self.host.monotonic() + PATIENT_S
        while True:
            leftovers = self.host.group_members(pgid) + self.host.descendants()
            self.host.reap_orphans(keep=set())
            if not leftovers:
                return
            if self.host.monotonic() > warn_at:
                log.error("job %s: processes %s survive SIGKILL; waiting for them to go", self.job_id, leftovers)
                self.output.note(f"processes {leftovers} survive SIGKILL; the job ends when they are gone")
                warn_at = self.host.monotonic() + WARN_EVERY_S
            self.kill_everything(pgid, signal.SIGKILL)
            self.host.sleep(0.05 if self.host.monotonic() < patient_until else 1.0)  # each pass lists every process

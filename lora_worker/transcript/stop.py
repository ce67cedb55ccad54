"""One stop schedule for every backend: SIGTERM, then SIGKILL once the grace is over. Pure.

The schedule is a small state machine, NONE → TERM_SENT → KILL_SENT, entered once, for one reason; a later
reason (a cancel after a stall) changes nothing, the first one decides the outcome. It says *when*; the
backend says *how*: the local stopper (run/stopper.py) signals the trainer's process group and descendants,
Slurm (slurm/job.py) sends `scancel --signal=TERM|KILL --full`.
"""
from __future__ import annotations

from enum import Enum


class StopReason(Enum):
    CANCEL = "cancel"  # a client asked: the only reason a job ends `cancelled`
    # The supervisor itself got SIGTERM, SIGINT or SIGHUP: systemd stopping the unit (its final sweep at a reboot,
    # `systemctl kill`), an operator. Nobody asked for a cancel: the job fails, `supervisor_signalled`.
    SIGNAL = "signal"
    NAN_LOSS = "nan_loss"  # the loss became NaN: nothing more can be learned
    STALL = "stall"  # the watchdog saw no progress within the phase's limit
    LOST = "lost"  # the row is no longer `running`: someone else ended the job
    ORPHANED = "orphaned"  # the launcher was killed and left its trainer running
    REQUEUED = "requeued"  # Slurm put a job that had run back in the queue: a second run is refused

    @property
    def cancels(self) -> bool:
        """Whether the job ends `cancelled` (asked to stop) rather than with what the trainer did."""
        return self is StopReason.CANCEL


class StopState(Enum):
    NONE = "none"
    TERM_SENT = "term_sent"  # SIGTERM sent; SIGKILL due at `deadline`
    KILL_SENT = "kill_sent"


class StopSchedule:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.state = StopState.NONE
        self.reason: StopReason | None = None
        self.deadline: float | None = None

    def begin(self, reason: StopReason, now: float) -> bool:
        """True if SIGTERM is to be sent now: the first stop, for `reason`."""
        if self.state is not StopState.NONE:
            return False
        self.state, self.reason, self.deadline = StopState.TERM_SENT, reason, now + self.grace_s
        return True

    def kill_due(self, now: float) -> bool:
        """True once, when the grace after SIGTERM is over: SIGKILL is to be sent now."""
        if self.state is StopState.TERM_SENT and self.deadline is not None and now >= self.deadline:
            self.state = StopState.KILL_SENT
            return True
        return False

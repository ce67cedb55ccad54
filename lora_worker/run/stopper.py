"""Stopping the trainer, the local way: SIGTERM to its group and our descendants, SIGKILL to whatever of the job
is left, and the wait until nothing of it is.

When to stop, and when TERM becomes KILL, is the follower's (transcript/follower.py, over transcript/stop.py's
schedule, the same one Slurm's jobs follow); this module says how, with the trainer's process group and the
supervisor's descendants.
"""
from __future__ import annotations

import logging
import signal

from lora_worker.transcript.facts import Order, Stop
from lora_worker.transcript.output import TrainerOutput
from lora_worker.run.seam import RunHost

log = logging.getLogger(__name__)

PATIENT_S = 30.0  # how long processes that outlive SIGKILL are polled quickly before the loop slows down
WARN_EVERY_S = 300.0
HOW = {Stop.TERM: (signal.SIGTERM, "SIGTERM to process group {pgid}"),
       Stop.KILL: (signal.SIGKILL, "SIGKILL to the job's processes")}


class Stopper:
    """Stops one job's processes: the group catches the launcher, the trainer and its workers; the
    descendants catch a grandchild that started its own session (we are their subreaper)."""

    def __init__(self, host: RunHost, output: TrainerOutput, job_id: int) -> None:
        self.host = host
        self.output = output
        self.job_id = job_id

    def deliver(self, pgid: int, order: Order) -> None:
        """The follower's stop: TERM or KILL to every process of the job (nothing is queued here to cancel)."""
        sig, how = HOW[order.stop]
        self.output.note(f"{order.why}; {how.format(pgid=pgid)}")
        self.kill_everything(pgid, sig)

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

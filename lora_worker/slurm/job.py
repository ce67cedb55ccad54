"""One Slurm job followed by the poller: the Slurm adapter of the job's follower (transcript/follower.py), which
owns the output, progress, stop decision and verified end for every backend. What is Slurm's here: how it
watches (`scheduler` answers, read by the poller once per cycle for every job; the node's log, `NodeLog`), how
it stops (`scancel`), how it learns the exit (the `.rc` file, sacct/scontrol: `states.ending`), and what the
scheduler adds (the queue reason, a requeue, its own endings).

`observe` takes the job's row and what Slurm last said of it, and returns True once nothing is left to do for
the row (it ended, or someone else ended it). Its stage decides:
- PENDING: the row stays `queued`, with Slurm's reason in `queue_reason`; pending again after it ran is a
  requeue (despite --no-requeue): a second run under the same id is refused, the job stopped, `node_fail`.
- RUNNING: the row becomes `running` (once), then carries the progress of the log.
- ENDED: the follower decides the end from `states.ending`'s facts and its own, once the ending has settled
  (the `.rc` file is there, or one more cycle passed: a CANCELLED job's ExitCode reads `0:0` first).
- UNLISTED: only an answer from accounting counts; after UNKNOWN_CYCLES answered cycles the job is
  scancelled (it may still run) and settled with what is left (the `.rc` file, or `slurm_lost`).
- UNKNOWN (a state word this worker does not know): nothing changes; it is not an answer.
A stop the follower orders (a cancel, a stall, a NaN loss, a requeue) is a plain scancel while the job is
pending, else TERM then KILL as `scancel --signal=… --full`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, timedelta

from lora_worker.config import Settings
from lora_worker.ledger.models import Job, utcnow
from lora_worker.slurm.ledger import SlurmLedger
from lora_worker.slurm.nodelog import NodeLog
from lora_worker.slurm.sbatch import log_path, refused_outcome
from lora_worker.slurm.scheduler import Scheduler, SlurmJob
from lora_worker.slurm.states import Stage, ending, stage
from lora_worker.states import FailureClass, JobState
from lora_worker.transcript.ending import Reasons, ended
from lora_worker.transcript.follower import Exit, Facts, Follower, Order, Stop, Timing
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.resume import ResumedLog, resumed

log = logging.getLogger(__name__)

UNKNOWN_CYCLES = 3  # answered cycles in a row in which no command lists a job, before it counts as lost
SLURM_REASONS = Reasons(succeeded="Slurm job completed and the LoRA verified",
                        cancelled="cancelled; Slurm says the job ended", failed="The Slurm job failed",
                        failure=FailureClass.SLURM_LOST)


class _Clock:
    def __init__(self, monotonic: Callable[[], float]) -> None:
        self.monotonic = monotonic

    def sleep(self, seconds: float) -> None:
        """The poller never waits on the ledger: what it refuses is written next cycle."""


class SlurmRun:
    """The Slurm adapter of one job's follower (transcript/follower.py), which decides when to stop and how the
    job ends. This says how the bytes arrive (the node's log, `NodeLog`), how a stop is delivered (`scancel`),
    how the exit is learned (the `.rc` file, sacct/scontrol: `states.ending`), and what Slurm adds (the queue
    reason, a requeue, its own endings)."""

    def __init__(self, job: Job, settings: Settings, ledger: SlurmLedger, scheduler: Scheduler,
                 monotonic: Callable[[], float]) -> None:
        self.job, self.settings, self.ledger, self.scheduler = job, settings, ledger, scheduler
        self.monotonic = monotonic
        s = settings
        make = ResumedLog if resumed(s.log_dir, job.id) else JobLog
        self.follower = Follower(job, make(s.log_dir, job.id, head_bytes=s.log_head_bytes, tail_bytes=s.log_tail_bytes),
                                 ledger, _Clock(monotonic), Timing(s.stall_limits_s, s.cancel_grace_s, 0.0),
                                 SLURM_REASONS, started=self._started_at(job))
        self.output = self.follower.output
        self.node_log = NodeLog(s, job.id, self.output)
        self.output.note(f"job {job.id} on Slurm (job {job.slurm_job_id or 'not submitted yet'}); its output as the "
                         f"node wrote it: {log_path(s, job.id)}"
                         + (f", from byte {self.node_log.logged} on" if self.node_log.logged else ""))
        self.stage = Stage.UNLISTED
        self.requeued: str | None = None  # seen pending again after it ran: what Slurm said
        self.unlisted_cycles = self.ended_cycles = 0
        self.gone = False  # the row ended elsewhere

    def _started_at(self, job: Job) -> float:
        """The row's start on the monotonic clock: elapsed time and the ETA count from it, not from attaching."""
        now = self.monotonic()
        if job.started_at is None:
            return now
        started = job.started_at if job.started_at.tzinfo else job.started_at.replace(tzinfo=UTC)
        return now - max(0.0, (utcnow() - started).total_seconds())

    # -- one cycle -------------------------------------------------------------------------------------

    def observe(self, job: Job, known: SlurmJob | None, *, answered: bool) -> bool:
        self.job = job
        if job.slurm_job_id is None:
            return self._unsubmitted()
        if self.follower.outcome is not None:  # decided already; only its writes are left
            return self._write_end()
        self.node_log.pump(self.monotonic())
        where = stage(known)
        if where is not Stage.UNKNOWN:
            self.stage = where
        step = {Stage.PENDING: self._pending, Stage.RUNNING: self._running, Stage.ENDED: self._ended,
                Stage.UNLISTED: self._unlisted, Stage.UNKNOWN: self._unknown}[where]
        return step(known, answered) or self.gone

    def _pending(self, known: SlurmJob | None, answered: bool) -> bool:
        self.unlisted_cycles = self.ended_cycles = 0
        if self.job.status == JobState.RUNNING.value and self.requeued is None:
            self.requeued = f"Slurm requeued job {self.job.slurm_job_id} ({known.detail if known else '?'})"
        self._tick(running=False)
        reason = known.reason if known else None
        if self.job.status == JobState.QUEUED.value and self.job.queue_reason != reason:
            self.ledger.record_queue_reason(self.job.id, reason)
        return False

    def _running(self, known: SlurmJob | None, answered: bool) -> bool:
        self.unlisted_cycles = self.ended_cycles = 0
        if self.job.status == JobState.QUEUED.value:
            self._mark_running()
        elif not self.follower.started:  # a poller taking up a job that already ran: it runs from now on here
            self.follower.start(self.monotonic())
        self._tick(running=True)
        return False

    def _ended(self, known: SlurmJob | None, answered: bool) -> bool:
        self.ended_cycles += 1
        if self.node_log.recorded_status() is not None or self.ended_cycles > 1:
            return self._end(known)
        return False

    def _unlisted(self, known: SlurmJob | None, answered: bool) -> bool:
        if not answered:  # no accounting answer: silence is never taken for an ending
            return False
        self.unlisted_cycles += 1
        if self.unlisted_cycles < UNKNOWN_CYCLES:
            return False
        self.scheduler.cancel(self.job.slurm_job_id or "")  # it may still run: stopped before the row ends
        self.output.note(f"Slurm lists job {self.job.slurm_job_id} nowhere; scancelled in case it still runs")
        return self._end(None)

    def _unknown(self, known: SlurmJob | None, answered: bool) -> bool:
        log.warning("job %s: Slurm says %r of job %s, a state this worker does not know; no change",
                    self.job.id, known.detail if known else "?", self.job.slurm_job_id)
        return False

    # -- stopping: the follower decides, scancel delivers ----------------------------------------------

    def _tick(self, *, running: bool) -> None:
        order = self.follower.tick(self.monotonic(), Facts(cancel=self.job.cancel_requested_at is not None,
                                                           requeued=self.requeued, running=running))
        if self.follower.lost:  # the row ended elsewhere: nobody follows the job any more, so Slurm ends it
            self.gone = True
            self.abandon()
        elif order is not None:
            self._deliver(order)

    def _deliver(self, order: Order) -> None:
        sid = self.job.slurm_job_id or ""
        if order.stop is Stop.CANCEL:
            self.scheduler.cancel(sid)
            self.output.note(f"{order.why}; scancel of the pending Slurm job {sid}")
            return
        word = "TERM" if order.stop is Stop.TERM else "KILL"
        self.scheduler.cancel(sid, word)
        self.output.note(f"{order.why}; SIG{word} to every process of Slurm job {sid}")

    def abandon(self) -> None:
        """The row ended elsewhere while Slurm may still run the job: it is stopped, not left running."""
        if self.job.slurm_job_id and self.stage.may_run and self.follower.outcome is None:
            self.scheduler.cancel(self.job.slurm_job_id)
            log.warning("job %s: its row ended elsewhere; Slurm job %s scancelled", self.job.id,
                        self.job.slurm_job_id)

    # -- the stages' writes ----------------------------------------------------------------------------

    def _mark_running(self) -> bool:
        if not self.ledger.mark_running(self.job.id):
            return False
        now = self.monotonic()
        self.follower.reporter.started = now
        self.follower.start(now)
        return True

    def _unsubmitted(self) -> bool:
        """A queued row without a Slurm id: dispatch is submitting it, or died doing so."""
        if utcnow() - self.job.created_at < timedelta(seconds=self.settings.launch_grace_s):
            return False
        return self.ledger.fail_job(self.job.id, failure_class=FailureClass.LAUNCH_ERROR,
                                    sentence="The submission to Slurm never completed (no Slurm job id was recorded)")

    def _end(self, known: SlurmJob | None) -> bool:
        """Slurm says the job ended: the follower decides how, once, from Slurm's facts and its own."""
        job = self.job
        self.node_log.pump(self.monotonic())
        recorded = self.node_log.recorded_status()
        refused = refused_outcome(self.settings, job.id, self.output.tail)  # the node's pre-exec look said no
        ran = self.follower.started or job.status == JobState.RUNNING.value or recorded is not None
        outcome = self.follower.decide(Exit(trainer_ran=False, settled=refused) if refused else ending(
            known, slurm_job_id=job.slurm_job_id or "?", recorded=recorded, requeued=self.requeued is not None,
            cancel_flagged=job.cancel_requested_at is not None, log_tail=self.output.tail, ran=ran))
        self.output.note(f"Slurm job {job.slurm_job_id}: {known.detail if known else 'unknown to Slurm'}; "
                         f"recorded return code {recorded}; the job is {ended(outcome)}")
        return self._write_end()

    def _write_end(self) -> bool:
        outcome = self.follower.outcome
        assert outcome is not None
        if not self.follower.started:
            if self.job.status == JobState.RUNNING.value:
                self.follower.started = True  # its last progress lands before the end
            elif outcome.state is not JobState.CANCELLED:
                self._mark_running()  # it ran between two cycles: a terminal state comes through `running`
        if self.follower.finish() is None:  # the ledger refused: the same end, written next cycle
            return False
        self.node_log.discard()
        return True

    def close(self) -> None:
        self.node_log.close()
        self.output.joblog.close()

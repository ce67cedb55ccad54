"""One job followed, on every backend: what happens to a running job, written once. The local supervisor
(run/runner.py `JobRun`) and the Slurm poller (slurm/job.py `SlurmRun`) are adapters around it; what the two
sides tell each other is in transcript/facts.py.

A backend gives the follower what only it knows, and does what only it can:
- the trainer's bytes as they arrive (`output.consume`: from the pipe, or from the node's log file);
- `start(now)` once the trainer runs (the stall watchdog counts from there), and on each pass `tick(now, Facts)`:
  what it saw besides the bytes (a client's cancel on the row, a signal to its own process, the scheduler's
  requeue, a launcher killed under its trainer, whether the trainer runs now or has already ended);
- the stop `tick` answers, delivered its own way: TERM, then KILL once the grace is over (the one StopSchedule),
  to the process group and descendants, or as `scancel --signal=… --full`; or, for a job its scheduler holds in
  the queue, the scheduler's plain cancel;
- how the job ended (`Exit`: the trainer's return code as the backend learned it, an outcome settled before the
  trainer ran, an ending its scheduler caused).
The follower owns the rest: the output (parser, run log, error tail), the ETA, the progress writes and step
checkpoints, the stall watchdog, the stop decision, and the verified end in one order: `decide` (the outcome,
the LoRA verified against the row), then `finish` (a LoRA that is no result set aside, the last progress, the
final row and its webhook events, then the states of an end no resume can follow dropped).

The stop: the first reason decides and a later one changes nothing. On a pass they are looked at in this order:
an orphaned trainer, the row ended elsewhere, a client's cancel, a signal to the follower's process, a requeue,
a stall (only while the trainer runs), a NaN loss. A trainer that had already ended keeps its own outcome.

The end, strongest evidence first: an outcome the backend settled (the trainer never started, or the follower's
process failed); a client's cancel that reached the job; the follower's own reason to stop it (a stall, a
signal, a NaN loss; a NaN the trainer outran by ending first too: its LoRA holds NaN weights); an ending the
scheduler caused (time limit, memory, node, a cancel nobody here asked for, a requeue); then the trainer's exit
status, its `model saved.` and the LoRA verified.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lora_worker.states import JobState, Phase
from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.ending import Reasons, drop_states, ended, serves_no_resume, write_final
from lora_worker.transcript.eta import EtaClock, estimate_tail
from lora_worker.transcript.facts import Exit, Facts, FollowedJob, FollowerLedger, Order, Stop, Timing
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.outcome import Outcome, artifact_values, decide, recorded_lora
from lora_worker.transcript.output import TrainerOutput
from lora_worker.transcript.partial import set_aside
from lora_worker.transcript.persist import TRANSIENT
from lora_worker.transcript.progress import Clock, ProgressReporter
from lora_worker.transcript.samples import Samples, sample_every_of
from lora_worker.transcript.stop import StopReason, StopSchedule, StopState
from lora_worker.transcript.watchdog import Watchdog

__all__ = ["Exit", "Facts", "Follower", "Order", "Stop", "Timing"]

log = logging.getLogger(__name__)
LOST = "the job is no longer running in the ledger"


class Follower:
    def __init__(self, job: FollowedJob, joblog: JobLog, ledger: FollowerLedger, clock: Clock, timing: Timing,
                 reasons: Reasons, started: float | None = None) -> None:
        self.job, self.ledger, self.clock, self.timing, self.reasons = job, ledger, clock, timing, reasons
        self.output = TrainerOutput(joblog, self._on_output, step_offset=job.resume_step)
        # The tail (save and teardown after the last step) is learned from the history once the trainer runs.
        self.eta = EtaClock(job.total_steps, estimated_duration_s=job.estimated_duration_s, first_step=job.resume_step,
                            sample_every=sample_every_of(job.argv))
        self.reporter = ProgressReporter(ledger, job.id, clock, self.output, self.eta, timing.progress_interval_s,
                                         on_lost=self._lost, started=started, checkpoints=Checkpoints(job),
                                         samples=Samples(job))
        self.watchdog = Watchdog(timing.stall_limits_s, clock.monotonic())
        self.schedule = StopSchedule(timing.grace_s)
        self.started = False  # the trainer runs (or ran): the row is `running`
        self.lost = False
        self.plain: StopReason | None = None  # the scheduler's plain cancel of a queued job, once, and why
        self.signalled: str | None = None
        self.tail_learned = False
        self.outcome: Outcome | None = None
        self.artifact: dict[str, object] = {}
        self._ran = False
        self._aside: str | None = None  # the set-aside sentence still to note; "" once nothing is left to do
        self._flushed = False

    @property
    def reason(self) -> StopReason | None:
        """Why the follower stopped the job (the first reason), None while it has not."""
        return self.schedule.reason or self.plain

    # -- while it runs -------------------------------------------------------------------------------------

    def start(self, now: float) -> None:
        """The trainer runs from `now` (called once it does: nothing here holds up its start): its silence counts
        from here, the row is `running`, and the ETA's tail is read from the history."""
        self.started = True
        self.watchdog.restart(now)
        self._learn_tail()

    def tick(self, now: float, facts: Facts) -> Order | None:
        """One pass: the log's clock, the progress write when due, and the stop to send now, if any."""
        self.output.tick(now)
        if self.started and facts.running:
            if not self.tail_learned:
                self._learn_tail()
            if self.reporter.due(now):
                self.reporter.flush()
        if self.schedule.state is StopState.NONE and not facts.ended:
            found = self._why(facts, now)
            if found is not None:
                return self._begin(*found, facts, now)
        if facts.running and self.schedule.kill_due(now):
            return Order(Stop.KILL, f"still running {self.timing.grace_s:g}s after SIGTERM")
        return None

    def _begin(self, reason: StopReason, why: str, facts: Facts, now: float) -> Order | None:
        if not facts.running:  # in the scheduler's queue: its plain cancel, once
            if self.plain is not None:
                return None
            self.plain = reason
            return Order(Stop.CANCEL, why)
        self.schedule.begin(reason, now)
        if reason is StopReason.SIGNAL:
            self.signalled = facts.signalled
        log.info("job %s: %s; stopping the trainer", self.job.id, why)
        return Order(Stop.TERM, why)

    def _why(self, facts: Facts, now: float) -> tuple[StopReason, str] | None:
        if self.plain is not None:  # cancelled in the queue, and started all the same: stopped as it runs
            return self.plain, "stopping the job cancelled in the queue"
        if facts.orphaned is not None:
            return StopReason.ORPHANED, facts.orphaned
        if self.lost or facts.lost:
            self.lost = True
            return StopReason.LOST, LOST
        if facts.cancel:
            return StopReason.CANCEL, "cancel requested"
        if facts.signalled is not None:
            return StopReason.SIGNAL, f"supervisor received {facts.signalled}"
        if facts.requeued is not None:
            return StopReason.REQUEUED, facts.requeued
        if facts.running and self.started and (why := self.watchdog.check(self.output.progress.phase, now)):
            return StopReason.STALL, why
        if (nan_at := self.output.progress.nan_at) is not None:
            return StopReason.NAN_LOSS, f"the loss became NaN at step {nan_at}"
        return None

    def _on_output(self, phase: Phase, step: int) -> None:
        p = self.output.progress
        now = self.clock.monotonic()
        self.watchdog.saw_output(phase, step, p, now)
        self.eta.follow(p.phase, p.step, now)
        if p.phase is not phase and self.started:
            self.reporter.flush(force=True)

    def _learn_tail(self) -> None:
        """The save and teardown after the last step, as jobs of this tier and device took them. Read once the
        trainer runs, and never waited on: a ledger that refuses the read is asked again on the next tick."""
        try:
            tails = self.ledger.save_and_teardown_durations(backend=self.job.backend, tier=self.job.tier,
                                                            device_index=self.job.device_index)
        except TRANSIENT as exc:
            log.warning("job %s: cannot read the history yet (%s); will retry", self.job.id, exc)
            return
        self.eta.tail_s = estimate_tail(tails)
        self.tail_learned = True

    def _lost(self) -> None:
        self.lost = True  # the ledger refused a progress write: the row is no longer `running`

    # -- the end ---------------------------------------------------------------------------------------------

    def decide(self, end: Exit) -> Outcome:
        """The outcome, decided once (the LoRA verified here); later calls return it."""
        if self.outcome is None:
            if not self.output.ended:
                self.output.end()
            self.outcome = self._decide(end)
            self._ran = end.trainer_ran
        return self.outcome

    def _decide(self, end: Exit) -> Outcome:
        if end.settled is not None:
            return end.settled
        p, reason = self.output.progress, self.reason
        base: dict[str, Any] = {"returncode": end.returncode, "progress": p, "log_tail": self.output.tail}
        if reason is StopReason.CANCEL or (reason is None and end.cancel_seen):
            return decide(cancelled=True, **base)
        stopped = self._stopped(reason, end)
        if stopped:
            return decide(**base, **stopped)
        if end.scheduler is not None:
            return end.scheduler
        artifact = None
        if end.returncode == 0 and reason is None and "model_saved" in p.flags:
            from lora_worker.host.safetensors import verify_lora  # loaded once the trainer runs (END_MODULES)

            artifact = verify_lora(Path(self.job.lora_file), recorded_lora(self.job))  # held to the row
            if artifact.problem is None:
                self.artifact = artifact_values(artifact, recorded_commit=self.job.sd_scripts_commit)
        return decide(artifact=artifact, **base)

    def _stopped(self, reason: StopReason | None, end: Exit) -> dict[str, Any]:
        """The follower's own cause of the end, as `decide` takes it; {} when it has none."""
        nan_at = self.output.progress.nan_at
        if reason is StopReason.STALL:
            return {"stalled_in": self.watchdog.stalled_in}
        if reason is StopReason.SIGNAL:
            return {"signalled": self.signalled}
        if reason is StopReason.NAN_LOSS or (reason is None and end.scheduler is None and nan_at is not None):
            return {"nan_at": nan_at}
        return {}

    def finish(self) -> bool | None:
        """After `decide`: a LoRA that is no result set aside, the last progress, then the final row and its
        webhook events (then the states dropped, of an end no resume can follow: a success, a cancel, a failure
        a resume would meet again). True once written, False if the row had ended
        elsewhere, None if the ledger refused a step: call again (the supervisor after a pause, the poller on
        its next cycle); each step is done once."""
        outcome = self.outcome
        assert outcome is not None, "decide first"
        try:
            self._set_aside(outcome)
            if self.started and not self._flushed:
                if not self.reporter.flush(force=True):  # the last loss points land before the end
                    return None
                self._flushed = True
            written = write_final(self.ledger, self.job.id, outcome, self.output.progress, self.reasons,
                                  artifact=self.artifact)
        except TRANSIENT as exc:
            log.warning("job %s: the end is not written yet (%s); will retry", self.job.id, exc)
            return None
        if not written:
            log.warning("job %s: already ended elsewhere; %s not recorded", self.job.id, outcome.state.value)
        elif serves_no_resume(outcome, self.reasons.failure):
            drop_states(self.job.output_dir, self.job.output_name, self.job.id, self.job.output_dev_ino)
        log.info("job %s: %s", self.job.id, ended(outcome))
        return written

    def _set_aside(self, outcome: Outcome) -> None:
        """What lies at the LoRA's path when a trainer of the job ran and the job does not end `succeeded`: moved
        aside once, and said in the job's events (a note the ledger refused is written on the next call)."""
        if self._aside is None:
            job = self.job
            moved = self._ran and outcome.state is not JobState.SUCCEEDED
            self._aside = (set_aside(job.id, job.lora_file, job.output_dir, job.output_dev_ino, self.output)
                           if moved else None) or ""
        if self._aside:
            self.ledger.note(self.job.id, self._aside)
            self._aside = ""


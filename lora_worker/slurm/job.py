"""One Slurm job followed by the poller, with the parts the local supervisor's run has: the trainer's output
(transcript/output.py) from the node's log, the progress reporter, the watchdog, the stop schedule and the
outcome → row write (transcript/). Only how it watches (`scheduler` answers, read by the poller once per
cycle for every job) and how it signals (`scancel`) are Slurm's.

`observe` takes the job's row and what Slurm last said of it, and returns True once nothing is left to do for
the row (it ended, or someone else ended it). Its stage decides:
- PENDING: the row stays `queued`, with Slurm's reason in `queue_reason`; pending again after it ran is a
  requeue (despite --no-requeue): a second run under the same id is refused, the job stopped, `node_fail`.
- RUNNING: the row becomes `running` (once), then carries the progress of the log.
- ENDED: the row's terminal state is `states.settle`'s, once the ending has settled (the `.rc` file is there,
  or one more cycle passed: a CANCELLED job's ExitCode reads `0:0` first).
- UNLISTED: only an answer from accounting counts; after UNKNOWN_CYCLES answered cycles the job is
  scancelled (it may still run) and settled with what is left (the `.rc` file, or `slurm_lost`).
- UNKNOWN (a state word this worker does not know): nothing changes; it is not an answer.
A stop (a cancel, a stall, a requeue) is a plain scancel while pending, else the stop schedule's TERM then
KILL as `scancel --signal=… --full`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, timedelta
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.host.safetensors import ArtifactCheck, verify_lora
from lora_worker.ledger.models import Job, utcnow
from lora_worker.slurm.ledger import SlurmLedger
from lora_worker.slurm.nodelog import NodeLog
from lora_worker.slurm.sbatch import log_path, refused_outcome
from lora_worker.slurm.scheduler import Scheduler, SlurmJob
from lora_worker.slurm.states import Stage, settle, stage
from lora_worker.states import FailureClass, JobState, Phase
from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.ending import Reasons, drop_states, ended, write_final
from lora_worker.transcript.eta import EtaClock
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.outcome import Outcome, artifact_values, recorded_lora
from lora_worker.transcript.output import TrainerOutput
from lora_worker.transcript.progress import ProgressReporter
from lora_worker.transcript.resume import ResumedLog, resumed
from lora_worker.transcript.stop import StopReason, StopSchedule
from lora_worker.transcript.watchdog import Watchdog

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
    def __init__(self, job: Job, settings: Settings, ledger: SlurmLedger, scheduler: Scheduler,
                 monotonic: Callable[[], float]) -> None:
        self.job, self.settings, self.ledger, self.scheduler = job, settings, ledger, scheduler
        self.monotonic = monotonic
        s = settings
        make = ResumedLog if resumed(s.log_dir, job.id) else JobLog
        self.output = TrainerOutput(make(s.log_dir, job.id, head_bytes=s.log_head_bytes, tail_bytes=s.log_tail_bytes),
                                    self._saw_output, step_offset=job.resume_step)
        self.node_log = NodeLog(s, job.id, self.output)
        self.output.note(f"job {job.id} on Slurm (job {job.slurm_job_id or 'not submitted yet'}); its output as the "
                         f"node wrote it: {log_path(s, job.id)}"
                         + (f", from byte {self.node_log.logged} on" if self.node_log.logged else ""))
        self.clock = EtaClock(job.total_steps, estimated_duration_s=job.estimated_duration_s,
                              first_step=job.resume_step)
        self.reporter = ProgressReporter(ledger, job.id, _Clock(monotonic), self.output, self.clock, 0.0,
                                         on_lost=self._lost, started=self._started_at(job),
                                         checkpoints=Checkpoints(job))
        self.watchdog: Watchdog | None = None  # from the first cycle that sees the job run
        self.stop = StopSchedule(s.cancel_grace_s)
        self.plain_cancel: StopReason | None = None  # the plain scancel of a pending job, and why
        self.stage = Stage.UNLISTED
        self.requeued = False  # seen pending again after it ran
        self.unlisted_cycles = self.ended_cycles = 0
        self.final: tuple[Outcome, dict[str, object]] | None = None  # the outcome, once decided
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
        if self.final is not None:  # decided already; only its write is left
            return self._finish(known)
        self.node_log.pump(self.monotonic())
        p = self.output.progress
        self.clock.follow(p.phase, p.step, self.monotonic())
        where = stage(known)
        if where is not Stage.UNKNOWN:
            self.stage = where
        step = {Stage.PENDING: self._pending, Stage.RUNNING: self._running, Stage.ENDED: self._ended,
                Stage.UNLISTED: self._unlisted, Stage.UNKNOWN: self._unknown}[where]
        return step(known, answered) or self.gone

    def _pending(self, known: SlurmJob | None, answered: bool) -> bool:
        self.unlisted_cycles = self.ended_cycles = 0
        if self.job.status == JobState.RUNNING.value and not self.requeued:
            self.requeued = True
            self.output.note(f"Slurm requeued job {self.job.slurm_job_id} ({known.detail if known else '?'}); "
                             "stopping it")
        self._drive_stop()
        reason = known.reason if known else None
        if self.job.status == JobState.QUEUED.value and self.job.queue_reason != reason:
            self.ledger.record_queue_reason(self.job.id, reason)
        return False

    def _running(self, known: SlurmJob | None, answered: bool) -> bool:
        self.unlisted_cycles = self.ended_cycles = 0
        now = self.monotonic()
        if self.watchdog is None:
            self.watchdog = Watchdog(self.settings.stall_limits_s, now)
        if self.watchdog.stalled_in is None and self.job.cancel_requested_at is None \
                and (why := self.watchdog.check(self.output.progress.phase, now)):
            self.output.note(f"stalled: {why}; stopping Slurm job {self.job.slurm_job_id}")
        self._drive_stop()
        if self.job.status == JobState.QUEUED.value:
            self._mark_running()
        self.reporter.flush()
        return False

    def _ended(self, known: SlurmJob | None, answered: bool) -> bool:
        self.ended_cycles += 1
        if self.node_log.recorded_status() is not None or self.ended_cycles > 1:
            return self._finish(known)
        return False

    def _unlisted(self, known: SlurmJob | None, answered: bool) -> bool:
        if not answered:  # no accounting answer: silence is never taken for an ending
            return False
        self.unlisted_cycles += 1
        if self.unlisted_cycles < UNKNOWN_CYCLES:
            return False
        self.scheduler.cancel(self.job.slurm_job_id or "")  # it may still run: stopped before the row ends
        self.output.note(f"Slurm lists job {self.job.slurm_job_id} nowhere; scancelled in case it still runs")
        return self._finish(None)

    def _unknown(self, known: SlurmJob | None, answered: bool) -> bool:
        log.warning("job %s: Slurm says %r of job %s, a state this worker does not know; no change",
                    self.job.id, known.detail if known else "?", self.job.slurm_job_id)
        return False

    # -- stopping --------------------------------------------------------------------------------------

    def _stop_reason(self) -> StopReason | None:
        if self.job.cancel_requested_at is not None:
            return StopReason.CANCEL
        if self.requeued:
            return StopReason.REQUEUED
        if self.watchdog is not None and self.watchdog.stalled_in is not None:
            return StopReason.STALL
        return None

    def _drive_stop(self) -> None:
        reason, sid = self._stop_reason(), self.job.slurm_job_id or ""
        if reason is None and self.stop.reason is None:
            return
        if self.stage is Stage.PENDING:
            if self.plain_cancel is None and reason is not None:
                self.scheduler.cancel(sid)
                self.plain_cancel = reason
                self.output.note("stopping: scancel of the pending Slurm job")
            return
        now = self.monotonic()
        if reason is not None and self.stop.begin(reason, now):
            self.scheduler.cancel(sid, "TERM")
            self.output.note(f"stopping: SIGTERM to every process of Slurm job {sid}")
        elif self.stop.kill_due(now):
            self.scheduler.cancel(sid, "KILL")
            self.output.note(f"still running {self.settings.cancel_grace_s:g}s after SIGTERM: SIGKILL")

    def _cancelled(self, known: SlurmJob | None) -> bool:
        """The worker's cancel reached the job: its stop was sent, or Slurm says it cancelled the job after
        the worker asked (a restarted poller does not know what its predecessor sent)."""
        sent = self.stop.reason or self.plain_cancel
        if sent is not None:
            return sent.cancels
        return self.job.cancel_requested_at is not None and known is not None and known.state == "CANCELLED"

    def abandon(self) -> None:
        """The row ended elsewhere while Slurm may still run the job: it is stopped, not left running."""
        if self.job.slurm_job_id and self.stage.may_run and self.final is None:
            self.scheduler.cancel(self.job.slurm_job_id)
            log.warning("job %s: its row ended elsewhere; Slurm job %s scancelled", self.job.id,
                        self.job.slurm_job_id)

    def _lost(self) -> None:
        self.gone = True
        self.abandon()

    # -- the stages' writes ----------------------------------------------------------------------------

    def _mark_running(self) -> bool:
        if not self.ledger.mark_running(self.job.id):
            return False
        self.reporter.started = self.monotonic()
        return True

    def _unsubmitted(self) -> bool:
        """A queued row without a Slurm id: dispatch is submitting it, or died doing so."""
        if utcnow() - self.job.created_at < timedelta(seconds=self.settings.launch_grace_s):
            return False
        return self.ledger.fail_job(self.job.id, failure_class=FailureClass.LAUNCH_ERROR,
                                    sentence="The submission to Slurm never completed (no Slurm job id was recorded)")

    def _decide(self, known: SlurmJob | None) -> tuple[Outcome, dict[str, object]]:
        job = self.job
        self.node_log.pump(self.monotonic())
        self.output.end()
        recorded = self.node_log.recorded_status()
        artifact: list[ArtifactCheck] = []

        def verify() -> ArtifactCheck:
            artifact.append(verify_lora(Path(job.lora_file), recorded_lora(job)))  # held to the row
            return artifact[-1]

        refused = refused_outcome(self.settings, job.id, self.output.tail)  # the node's pre-exec look said no
        outcome = refused or settle(known, slurm_job_id=job.slurm_job_id or "?", recorded=recorded,
                                    cancelled=self._cancelled(known), requeued=self.requeued,
                                    stalled_in=self.watchdog.stalled_in if self.watchdog else None,
                                    progress=self.output.progress, log_tail=self.output.tail, verify=verify)
        extra = artifact_values(artifact[-1], recorded_commit=job.sd_scripts_commit) \
            if artifact and outcome.state is JobState.SUCCEEDED else {}
        self.output.note(f"Slurm job {job.slurm_job_id}: {known.detail if known else 'unknown to Slurm'}; "
                         f"recorded return code {recorded}; the job is {ended(outcome)}")
        return outcome, extra

    def _finish(self, known: SlurmJob | None) -> bool:
        if self.final is None:  # decided once; a write the ledger refused is retried next cycle, as decided
            self.final = self._decide(known)
        outcome, extra = self.final
        running = self.job.status == JobState.RUNNING.value
        if not running and outcome.state is not JobState.CANCELLED:
            running = self._mark_running()  # it ran between two cycles: a terminal state comes through `running`
        if running and not self.reporter.flush(force=True):  # the last loss points land before the end
            return False
        if write_final(self.ledger, self.job.id, outcome, self.output.progress, SLURM_REASONS, artifact=extra):
            log.info("job %s: %s", self.job.id, ended(outcome))
            if outcome.state is JobState.SUCCEEDED:
                drop_states(self.job.output_dir, self.job.output_name, self.job.id)
        self.node_log.discard()
        return True

    def _saw_output(self, phase: Phase, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.saw_output(phase, step, self.output.progress, self.monotonic())

    def close(self) -> None:
        self.node_log.close()
        self.output.joblog.close()

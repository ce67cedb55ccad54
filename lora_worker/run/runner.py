"""The run loop of one job: start the stored argv, read its output, keep the ledger current, stop it when asked
or when it stalls, and record one honest terminal state.

The parts: `OutputReader` (the pipe), `ProgressReporter` (the ledger while it runs), `Watchdog` (stalls),
`Stopper` (TERM, grace, KILL), and the outcome step here. Every OS call goes through a `RunHost`.

Order at the end matters: every process of the job is gone, then the GPU lock goes (before a full or locked ledger
is waited on, or the LoRA hashed), then the terminal state (retried until the ledger takes it), then the job lock.
"""
from __future__ import annotations

import importlib
import logging
import shlex
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from lora_worker.config import Settings
from lora_worker.host.locks import gpu_lock_path
from lora_worker.host.processes import decode_wait_status
from lora_worker.host import sandbox
from lora_worker.ledger.statements import utcnow
from lora_worker.ledger.supervisor import JobRecord, SupervisorLedger
from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.eta import EtaClock, estimate_tail
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.ending import Reasons, drop_states, ended, write_final
from lora_worker.transcript.outcome import Outcome, artifact_values, decide, recorded_lora
from lora_worker.transcript.output import TrainerOutput
from lora_worker.transcript.persist import TRANSIENT, persist
from lora_worker.transcript.progress import ProgressReporter
from lora_worker.run.reader import OutputReader
from lora_worker.run.requests import StopRequests
from lora_worker.run.seam import RunHost, Trainer
from lora_worker.run.jobfiles import open_run_log, set_aside
from lora_worker.run.stopper import StopReason, Stopper, StopState
from lora_worker.transcript.watchdog import Watchdog
from lora_worker.states import FailureClass, JobState, Phase

if TYPE_CHECKING:
    from lora_worker.host.safetensors import ArtifactCheck

log = logging.getLogger(__name__)
# What only the end of a run uses: imported once the trainer runs (`load_the_end`), so that its start waits
# for none of it (the LoRA check's hashlib brings OpenSSL: 3.5 MiB and a few ms) and the end pays no import.
END_MODULES = ("lora_worker.transcript.explain", "lora_worker.host.safetensors", "lora_worker.host.fingerprint")

GPU_LOCK_WAIT_S = 2.0  # an admission probe holds it shared for microseconds; a trainer holds it for hours
DRAIN_GRACE_S = 10.0  # after the launcher exits, how long stragglers may hold the pipe
COALESCE_S = 0.25  # the loop's shortest period while the trainer writes little (reader.BUSY_BYTES)
LOCAL_REASONS = Reasons(succeeded="trainer finished and the LoRA verified",
                        cancelled="cancelled; every process of the job is gone")


def attend(job_id: int, settings: Settings, host: RunHost, db: SupervisorLedger, job_lock: int) -> int:
    """Run the job while holding its lock (`job_lock`), and release the lock last: from then on reconcile may
    treat the job as unattended."""
    try:
        Runner(job_id, settings, db, host).run()
    except Exception:
        log.exception("job %s: supervisor failed", job_id)
        return 1
    finally:
        db.close()
        host.release_lock(job_lock)
    return 0


class Runner:
    """Supervises one job from `queued` to a terminal state."""

    def __init__(self, job_id: int, settings: Settings, db: SupervisorLedger, host: RunHost) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db = db
        self.host = host

    def run(self) -> None:
        job = persist(lambda: self.db.find_job(self.job_id), f"job {self.job_id}: read the job", self.host.sleep)
        if job is None or job.status != JobState.QUEUED.value:
            log.info("job %s is %s; nothing to run", self.job_id, job.status if job else "missing")
            return
        me = self.host.identity()
        assert me is not None
        if (joblog := open_run_log(self.job_id, self.settings, self.db, self.host.sleep)) is None:
            return
        if not persist(lambda: self.db.mark_running(
                self.job_id, started_at=utcnow(), phase=Phase.LAUNCHING.value, boot_id=me.boot_id,
                supervisor_pid=me.pid, supervisor_start_ticks=me.start_ticks),
                f"job {self.job_id}: record the start", self.host.sleep):
            log.info("job %s left the queue before it started", self.job_id)
            joblog.close()
            return
        JobRun(job, self.settings, self.db, self.host, joblog).run()


class JobRun:
    """One started job: its trainer, from the GPU lock to the terminal state."""

    def __init__(self, job: JobRecord, settings: Settings, db: SupervisorLedger, host: RunHost, joblog: JobLog) -> None:
        self.job = job
        self.job_id = job.id
        self.settings = settings
        self.db = db
        self.host = host
        self.joblog = joblog  # opened before the job was `running` (run/jobfiles.py)
        self.output = TrainerOutput(self.joblog, self._on_output, step_offset=job.resume_step)
        # The tail (save and teardown after the last step) is learned from the history once the trainer runs.
        self.clock = EtaClock(job.total_steps, estimated_duration_s=job.estimated_duration_s,
                              first_step=job.resume_step)
        self._tail_learned = False
        self.reader = OutputReader(host, self.output)
        self.reporter = ProgressReporter(db, job.id, host, self.output, self.clock, settings.progress_interval_s,
                                         on_lost=self._lost, checkpoints=Checkpoints(job))
        self.watchdog = Watchdog(settings.stall_limits_s, host.monotonic())
        self.stopper = Stopper(host, self.output, settings.cancel_grace_s, job.id)
        self.requests = StopRequests(db, job.id, self.stopper)
        self.trainer: Trainer | None = None
        self.artifact_values: dict[str, object] = {}
        self._exited_at: float | None = None
        self._gpu_fd: int | None = None

    def run(self) -> None:
        self._gpu_fd = self.host.take_lock(gpu_lock_path(self.settings, self.job.device_index), GPU_LOCK_WAIT_S)
        try:
            if self._gpu_fd is None:
                outcome = Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR,
                                  f"GPU {self.job.device_index} is locked by another trainer.")
            else:
                outcome = self._run_guarded(self.job)
        finally:
            self._free_gpu()  # every process of the job is gone by now (freed already after a trainer ran)
        set_aside(self.job, outcome, self.trainer is not None, self.db, self.output, self.host.sleep)  # no partial LoRA
        self._finish(outcome)
        self.joblog.close()

    def _run_guarded(self, job: JobRecord) -> Outcome:
        try:
            return self._run_trainer(job)
        except Exception as exc:
            # A bug here must not leave a trainer running unsupervised, nor the row "running".
            log.exception("job %s: supervisor error", self.job_id)
            if self.trainer is not None:
                self.stopper.ensure_gone(self.trainer.pid)
            return Outcome(JobState.FAILED, FailureClass.SUPERVISOR_LOST,
                           f"The supervisor hit an internal error ({type(exc).__name__}: {exc}); "
                           "every process of the job was stopped.", log_lines=tuple(self.output.tail))

    # -- the trainer -------------------------------------------------------------------------------------

    def _run_trainer(self, job: JobRecord) -> Outcome:
        simulated = "SIMULATED trainer (a test double: no GPU, nothing learned); " if self.settings.simulated else ""
        self.output.note(f"{simulated}job {job.id}: {shlex.join(job.argv)}")
        self.output.note(f"sandbox: {sandbox.describe(self.settings)}")
        self.host.become_subreaper()
        self.watchdog.restart(self.host.monotonic())  # the watchdog counts from the trainer's start
        if (moved := self.host.what_moved(job)) is not None:  # the last look, right before exec
            self.output.note(f"refusing to start the trainer: {moved}")
            return Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR, f"Refusing to start the trainer: {moved}.")
        try:  # the stored argv, in the job's sandbox (host/sandbox.py): only the job's paths exist there
            trainer = self.host.spawn(self.host.command_for(job, self.settings), cwd=self.settings.sd_scripts_dir,
                                      env=job.env)
        except OSError as exc:
            self.output.note(f"cannot start the trainer: {exc}")
            return Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR, f"Cannot start the trainer: {exc}",
                           log_lines=tuple(self.output.tail))
        self.trainer = trainer
        ident = self.host.identity(trainer.pid)
        # Reconcile needs these to kill a trainer whose supervisor died: kept until a write lands.
        self.reporter.keep(trainer_pid=trainer.pid, trainer_start_ticks=ident.start_ticks if ident else None)
        self.reporter.write()
        log.info("job %s: trainer group %s started", self.job_id, trainer.pid)
        self._learn_tail()  # only now: the trainer's start waits for nothing it does not need
        load_the_end()
        self._supervise(trainer)
        self.stopper.ensure_gone(trainer.pid)
        self._free_gpu()
        trainer.close()
        self.reporter.flush_until_taken()
        rc = sandbox.wait_status(trainer.returncode, self.settings)  # the launcher's own, through bwrap
        self.output.note(f"trainer ended: {decode_wait_status(rc)}")
        return self._outcome(job, rc)

    def _supervise(self, trainer: Trainer) -> None:
        restore = self.host.on_stop_signals(self.requests.on_signal)
        try:
            while self.reader.open or trainer.poll() is None:
                started = self.host.monotonic()
                busy = self.reader.pump(trainer)
                if self.host.woken():
                    self.requests.wake()  # a cancel's signal: the ledger is looked at on this very pass
                now = self.host.monotonic()
                self._check_exit(trainer, now)
                self._tick(trainer, now)
                if not busy and self._exited_at is None:  # once the launcher has exited, only the drain is left
                    # Let output gather in the pipe: one wake-up, read and parse per COALESCE_S instead of one
                    # per redraw. The ledger is written once a second; only a wake-up ends the pause early.
                    self.host.pause(max(0.0, COALESCE_S - (self.host.monotonic() - started)))
        finally:
            restore()
        self.output.end()

    def _free_gpu(self) -> None:  # once, when no process of the job is alive (after `Stopper.ensure_gone`)
        if self._gpu_fd is not None:
            self.host.release_lock(self._gpu_fd)
            self._gpu_fd = None

    def _check_exit(self, trainer: Trainer, now: float) -> None:
        if trainer.poll() is not None and self._exited_at is None:
            self._exited_at = now
            if self.reader.open and trainer.returncode is not None and trainer.returncode < 0:
                # The launcher itself was killed; its trainer runs on orphaned and the run has failed
                # already, so stop the rest now rather than let it hold the GPU.
                self.stopper.begin(trainer, StopReason.ORPHANED,
                                   f"the launcher was {decode_wait_status(trainer.returncode)}")
        if self._exited_at is not None and self.reader.open and now - self._exited_at > DRAIN_GRACE_S:
            # accelerate waits for its trainer, so whatever still holds the pipe is a straggler.
            self.stopper.kill_everything(trainer.pid, signal.SIGKILL)

    def _on_output(self, phase: Phase, step: int) -> None:
        p = self.output.progress
        now = self.host.monotonic()
        self.watchdog.saw_output(phase, step, p, now)
        self.clock.follow(p.phase, p.step, now)
        if p.phase is not phase:
            self.reporter.flush(force=True)

    # -- periodic work -----------------------------------------------------------------------------------

    def _learn_tail(self) -> None:
        """The save and teardown after the last step, as jobs of this tier and device took them. Read once the
        trainer runs, and never waited on: a ledger that refuses the read is asked again on the next tick."""
        try:
            tails = self.db.save_and_teardown_durations(backend=self.job.backend, tier=self.job.tier,
                                                        device_index=self.job.device_index)
        except TRANSIENT as exc:
            log.warning("job %s: cannot read the history yet (%s); will retry", self.job_id, exc)
            return
        self.clock.tail_s = estimate_tail(tails)
        self._tail_learned = True

    def _tick(self, trainer: Trainer, now: float) -> None:
        if not self._tail_learned:
            self._learn_tail()
        self.output.tick(now)
        self.host.reap_orphans(keep={trainer.pid})
        if self.reporter.due(now):
            self.reporter.flush()
        self.requests.check(trainer, now)
        if self.stopper.state is StopState.NONE and (why := self.watchdog.check(self.output.progress.phase, now)):
            self.stopper.begin(trainer, StopReason.STALL, why)
        if self.stopper.state is StopState.NONE and (nan_at := self.output.progress.nan_at) is not None:
            self.stopper.begin(trainer, StopReason.NAN_LOSS, f"the loss became NaN at step {nan_at}")
        self.stopper.tick(trainer, now)

    def _lost(self) -> None:
        if self.trainer is not None:
            self.requests.lost(self.trainer)

    # -- the outcome -------------------------------------------------------------------------------------

    def _outcome(self, job: JobRecord, rc: int | None) -> Outcome:
        from lora_worker.host.safetensors import verify_lora

        reason, p = self.stopper.reason, self.output.progress
        artifact: ArtifactCheck | None = None
        if rc == 0 and reason is None and "model_saved" in p.flags:
            artifact = verify_lora(Path(job.lora_file), recorded_lora(job))  # held to the row, not the tier
            if artifact.problem is None:
                self.artifact_values = artifact_values(artifact, recorded_commit=self.job.sd_scripts_commit)
        return decide(returncode=rc, progress=p, log_tail=self.output.tail, cancelled=reason is StopReason.CANCEL,
                      stalled_in=self.watchdog.stalled_in, artifact=artifact,
                      signalled=self.requests.signal_name if reason is StopReason.SIGNAL else None,
                      nan_at=p.nan_at if reason is StopReason.NAN_LOSS else None)

    def _finish(self, outcome: Outcome) -> None:
        def write() -> bool:
            return write_final(self.db, self.job_id, outcome, self.output.progress, LOCAL_REASONS,
                               artifact=self.artifact_values)

        # The outcome is known and must not be lost: keep trying, holding the job lock meanwhile.
        if not persist(write, f"job {self.job_id}: write the final state", self.host.sleep):
            log.warning("job %s: already ended elsewhere; %s not recorded", self.job_id, outcome.state.value)
        elif outcome.state is JobState.SUCCEEDED:
            drop_states(self.job.output_dir, self.job.output_name, self.job_id)
        log.info("job %s: %s", self.job_id, ended(outcome))


def load_the_end() -> None:
    """Import END_MODULES; their users import them locally, so a run started without this still works."""
    for name in END_MODULES:
        importlib.import_module(name)

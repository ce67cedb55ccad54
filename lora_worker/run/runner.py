"""The local supervisor of one job: start the stored argv, pipe its output to the job's follower
(transcript/follower.py: progress, the stop decision, the verified end), deliver the stops it asks for, and hold
the GPU lock and the job lock around it all.

The parts: `OutputReader` (the pipe), `StopRequests` (the row's cancel flag, a signal to this process),
`Stopper` (TERM, KILL, the wait until every process is gone). Every OS call goes through a `RunHost`.

Order at the end matters: every process of the job is gone, then the GPU lock goes (before a full or locked ledger
is waited on, or the LoRA hashed), then the terminal state (retried until the ledger takes it), then the job lock.
"""
from __future__ import annotations

import importlib
import logging
import shlex
import signal

from lora_worker.config import Settings
from lora_worker.host.locks import gpu_lock_path
from lora_worker.host.processes import decode_wait_status
from lora_worker.host import sandbox
from lora_worker.ledger.statements import utcnow
from lora_worker.ledger.supervisor import JobRecord, SupervisorLedger
from lora_worker.transcript.ending import Reasons
from lora_worker.transcript.follower import Exit, Facts, Follower, Timing
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.outcome import Outcome
from lora_worker.transcript.persist import persist, until_done
from lora_worker.run.reader import OutputReader
from lora_worker.run.requests import StopRequests
from lora_worker.run.seam import RunHost, Trainer
from lora_worker.run.jobfiles import open_run_log
from lora_worker.run.stopper import Stopper
from lora_worker.states import FailureClass, JobState, Phase

log = logging.getLogger(__name__)
# What only the end of a run uses: imported once the trainer runs (`load_the_end`), so that its start waits
# for none of it (the LoRA check's hashlib brings OpenSSL: 3.5 MiB and a few ms) and the end pays no import.
END_MODULES = ("lora_worker.transcript.explain", "lora_worker.host.safetensors", "lora_worker.host.fingerprint")

GPU_LOCK_WAIT_S = 2.0  # an admission probe holds it shared for microseconds; a trainer holds it for hours
DRAIN_GRACE_S = 10.0  # after the launcher exits, how long stragglers may hold the pipe
COALESCE_S = 0.25  # the loop's shortest period while the trainer writes little (reader.BUSY_BYTES)
RUNNING = Facts()
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
    """One started job, from the GPU lock to the terminal state: the local adapter of the follower
    (transcript/follower.py), which decides when to stop and how the job ends. This says how the bytes arrive (the
    pipe), how a stop is delivered (the process group and our descendants), and how the exit is learned (the
    launcher's wait status, through bwrap)."""

    def __init__(self, job: JobRecord, settings: Settings, db: SupervisorLedger, host: RunHost, joblog: JobLog) -> None:
        self.job = job
        self.job_id = job.id
        self.settings = settings
        self.host = host
        self.joblog = joblog  # opened before the job was `running` (run/jobfiles.py)
        self.follower = Follower(job, joblog, db, host, Timing(settings.stall_limits_s, settings.cancel_grace_s,
                                                               settings.progress_interval_s), LOCAL_REASONS)
        self.output = self.follower.output
        self.reader = OutputReader(host, self.output)
        self.stopper = Stopper(host, self.output, job.id)
        self.requests = StopRequests(db, job.id)
        self.trainer: Trainer | None = None
        self._exited_at: float | None = None
        self._orphaned: str | None = None
        self._gpu_fd: int | None = None

    def run(self) -> None:
        self._gpu_fd = self.host.take_lock(gpu_lock_path(self.settings, self.job.device_index), GPU_LOCK_WAIT_S)
        try:
            if self._gpu_fd is None:
                self.follower.decide(refused(f"GPU {self.job.device_index} is locked by another trainer."))
            else:
                self._run_guarded(self.job)
        finally:
            self._free_gpu()  # every process of the job is gone by now (freed already after a trainer ran)
        # The outcome is known and must not be lost: written in the follower's order, retried while the job lock
        # is held.
        until_done(self.follower.finish, self.host.sleep)
        self.joblog.close()

    def _run_guarded(self, job: JobRecord) -> None:
        try:
            self.follower.decide(self._run_trainer(job))
        except Exception as exc:
            # A bug here must not leave a trainer running unsupervised, nor the row "running".
            log.exception("job %s: supervisor error", self.job_id)
            if self.trainer is not None:
                self.stopper.ensure_gone(self.trainer.pid)
            self.follower.decide(Exit(trainer_ran=self.trainer is not None, settled=Outcome(
                JobState.FAILED, FailureClass.SUPERVISOR_LOST,
                f"The supervisor hit an internal error ({type(exc).__name__}: {exc}); "
                "every process of the job was stopped.", log_lines=tuple(self.output.tail))))

    # -- the trainer -------------------------------------------------------------------------------------

    def _run_trainer(self, job: JobRecord) -> Exit:
        simulated = "SIMULATED trainer (a test double: no GPU, nothing learned); " if self.settings.simulated else ""
        self.output.note(f"{simulated}job {job.id}: {shlex.join(job.argv)}")
        self.output.note(f"sandbox: {sandbox.describe(self.settings)}")
        self.host.become_subreaper()
        if (moved := self.host.what_moved(job)) is not None:  # the last look, right before exec
            self.output.note(f"refusing to start the trainer: {moved}")
            return refused(f"Refusing to start the trainer: {moved}.")
        try:  # the stored argv, in the job's sandbox (host/sandbox.py): only the job's paths exist there
            trainer = self.host.spawn(self.host.command_for(job, self.settings), cwd=self.settings.sd_scripts_dir,
                                      env=job.env)
        except OSError as exc:
            self.output.note(f"cannot start the trainer: {exc}")
            return refused(f"Cannot start the trainer: {exc}", tuple(self.output.tail))
        self.trainer = trainer
        self.follower.start(self.host.monotonic())  # the watchdog counts from the trainer's start
        ident = self.host.identity(trainer.pid)
        # Reconcile needs these to kill a trainer whose supervisor died: kept until a write lands.
        self.follower.reporter.keep(trainer_pid=trainer.pid, trainer_start_ticks=ident.start_ticks if ident else None)
        self.follower.reporter.write()
        log.info("job %s: trainer group %s started", self.job_id, trainer.pid)
        load_the_end()  # only now, as the ETA's history: the trainer's start waits for nothing it does not need
        self._supervise(trainer)
        self.stopper.ensure_gone(trainer.pid)
        self._free_gpu()
        trainer.close()
        rc = sandbox.wait_status(trainer.returncode, self.settings)  # the launcher's own, through bwrap
        self.output.note(f"trainer ended: {decode_wait_status(rc)}")
        return Exit(returncode=rc)

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
                # The launcher itself was killed; its trainer runs on orphaned (a fact the follower stops on).
                self._orphaned = f"the launcher was {decode_wait_status(trainer.returncode)}"
        if self._exited_at is not None and self.reader.open and now - self._exited_at > DRAIN_GRACE_S:
            # accelerate waits for its trainer, so whatever still holds the pipe is a straggler.
            self.stopper.kill_everything(trainer.pid, signal.SIGKILL)

    def _tick(self, trainer: Trainer, now: float) -> None:
        self.host.reap_orphans(keep={trainer.pid})
        self.requests.check(now)
        requests, exited = self.requests, self._exited_at is not None
        if requests.cancel or requests.lost or requests.signalled is not None or exited:
            ended = exited and self._orphaned is None and not self.host.group_members(trainer.pid)
            facts = Facts(cancel=requests.cancel, lost=requests.lost, signalled=requests.signal_name,
                          orphaned=self._orphaned, ended=ended)
        else:
            facts = RUNNING  # the steady state: nothing to say but the bytes
        order = self.follower.tick(now, facts)
        if order is not None:
            self.stopper.deliver(trainer.pid, order)


def refused(sentence: str, log_lines: tuple[str, ...] = ()) -> Exit:
    """No trainer of the job started: a `launch_error`, whatever else happens."""
    return Exit(trainer_ran=False, settled=Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR, sentence,
                                                   log_lines=log_lines))


def load_the_end() -> None:
    """Import END_MODULES; their users import them locally, so a run started without this still works."""
    for name in END_MODULES:
        importlib.import_module(name)

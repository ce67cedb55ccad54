"""The run loop of one job: start the stored argv, read its output, keep the ledger current, stop it when asked
or when it stalls, and record one honest terminal state.

Order at the end matters: every process of the job is gone, then the GPU lock is released, then the terminal
state is written (retried until the ledger accepts it), and only then does the supervisor's own lock go.
"""
from __future__ import annotations

import logging
import math
import os
import selectors
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from lora_worker.host.safetensors import ArtifactCheck, verify_lora
from lora_worker.config import Settings
from lora_worker.errors import LedgerBusy, LedgerUnwritable
from lora_worker.host.fingerprint import SHA
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job, utcnow
from lora_worker.states import FailureClass, JobState, Phase
from lora_worker.run.eta import EtaClock, estimate_tail
from lora_worker.run.logfile import JobLog
from lora_worker.run.outcome import Outcome, decide, recorded_lora
from lora_worker.host import processes, sandbox
from lora_worker.host.locks import gpu_lock_path, take_lock
from lora_worker.run.output import STREAM, TrainerOutput
from lora_worker.run.prelaunch import what_moved

log = logging.getLogger(__name__)

READ_BYTES = 1 << 16
SELECT_TIMEOUT_S = 0.2
CANCEL_POLL_S = 0.5
GPU_LOCK_WAIT_S = 2.0  # an admission probe holds it shared for microseconds; a trainer holds it for hours
DRAIN_GRACE_S = 10.0  # after the launcher exits, how long stragglers may hold the pipe
COALESCE_S = 0.25  # the loop's shortest period while the trainer writes little…
BUSY_BYTES = 8 * 1024  # …that is, less than this per wake-up (a quarter second of redraws is ~250 bytes)
# What a locked, full or failing ledger raises (lora_worker.ledger.db sorts SQLite's errors): waited out or
# retried, never fatal to the run. Any other error (the file gone, the schema missing) is not waited on: the
# supervisor gives up its lock, and reconcile settles the row instead of a retry loop holding it "running".
TRANSIENT = (LedgerBusy, LedgerUnwritable)
T = TypeVar("T")


class Runner:
    """Supervises one job from `queued` to a terminal state."""

    def __init__(self, job_id: int, settings: Settings, db: Database) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db = db
        self.stop_reason: str | None = None  # "cancel", "signal", "stall", "lost", "orphaned"
        self.stalled_in: str | None = None
        self._kill_at: float | None = None
        self._killed_hard = False
        self._signalled: int | None = None
        self._last_write = 0.0
        self._last_cancel_poll = 0.0
        self._activity_at = time.monotonic()
        self._pending_points: dict[int, float | None] = {}
        self._pending_values: dict[str, object] = {}  # written with the next progress write that lands
        self._started = time.monotonic()
        self._training_at: datetime | None = None
        self.clock = EtaClock(total_steps=0, estimated_duration_s=None)
        self.artifact_values: dict[str, object] = {}

    # -- entry -------------------------------------------------------------------------------------------

    def run(self) -> None:
        job = _persist(lambda: repo.find_job(self.db, self.job_id), f"job {self.job_id}: read the job")
        if job is None or job.status != JobState.QUEUED.value:
            log.info("job %s is %s; nothing to run", self.job_id, job.status if job else "missing")
            return
        me = processes.identity_of(os.getpid())
        assert me is not None
        if not _persist(lambda: repo.transition(
                self.db, self.job_id, JobState.RUNNING, actor="supervisor", reason="supervisor started",
                started_at=utcnow(), phase=Phase.LAUNCHING.value, boot_id=me.boot_id, supervisor_pid=me.pid,
                supervisor_start_ticks=me.start_ticks), f"job {self.job_id}: record the start"):
            log.info("job %s left the queue before it started", self.job_id)
            return
        self.job = job
        self.joblog = JobLog(self.settings.log_dir, self.job_id, head_bytes=self.settings.log_head_bytes,
                             tail_bytes=self.settings.log_tail_bytes)
        self.output = TrainerOutput(self.joblog, self._on_output)
        tails = _persist(lambda: repo.save_and_teardown_durations(
            self.db, tier=job.tier, device_index=job.device_index), f"job {self.job_id}: read the history")
        self.clock = EtaClock(job.total_steps, estimated_duration_s=job.estimated_duration_s,
                              tail_s=estimate_tail(tails))
        self._started = time.monotonic()
        gpu_fd = take_lock(gpu_lock_path(self.settings, job.device_index), GPU_LOCK_WAIT_S)
        try:
            if gpu_fd is None:
                outcome = Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR,
                                  f"GPU {job.device_index} is locked by another trainer.")
            else:
                outcome = self._run_guarded(job)
        finally:
            if gpu_fd is not None:
                os.close(gpu_fd)  # every process of the job is gone by now
        self._finish(outcome)
        self.joblog.close()

    def _run_guarded(self, job: Job) -> Outcome:
        try:
            return self._run_trainer(job)
        except Exception as exc:
            # A bug here must not leave a trainer running unsupervised, nor the row "running".
            log.exception("job %s: supervisor error", self.job_id)
            if hasattr(self, "proc"):
                self._ensure_gone(self.proc.pid)
            return Outcome(JobState.FAILED, FailureClass.SUPERVISOR_LOST,
                           f"The supervisor hit an internal error ({type(exc).__name__}: {exc}); "
                           "every process of the job was stopped.", log_lines=tuple(self.output.tail))

    # -- the trainer -------------------------------------------------------------------------------------

    def _run_trainer(self, job: Job) -> Outcome:
        self.output.note(("SIMULATED trainer (a test double: no GPU, nothing learned); " if self.settings.simulated else "") + f"job {job.id}: {shlex.join(job.argv)}")
        self.output.note(f"sandbox: {sandbox.describe(self.settings)}")
        processes.set_child_subreaper()
        self._activity_at = time.monotonic()  # the watchdog counts from the trainer's start, not the supervisor's
        if (moved := what_moved(job)) is not None:  # the last look, right before exec
            self.output.note(f"refusing to start the trainer: {moved}")
            return Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR, f"Refusing to start the trainer: {moved}.")
        try:
            # The stored argv, run inside the job's sandbox (host/sandbox.py): only the job's paths exist there.
            command = sandbox.wrap(job.argv, sandbox.JobPaths(Path(job.dataset_dir), Path(job.base_model_path),
                                   Path(job.output_dir)), self.settings, sandbox.host_facts(self.settings))
            proc = subprocess.Popen(  # noqa: S603 - argv is the stored list; no shell
                command, cwd=self.settings.sd_scripts_dir, env=job.env, stdin=subprocess.DEVNULL,
                # One pipe for both streams: the kernel keeps the trainer's writes in the order they were made,
                # which two pipes cannot (a "saving checkpoint:" line must follow the redraw before it).
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                umask=0o002,  # outputs readable and writable by the shared group (arbo)
            )
        except OSError as exc:
            self.output.note(f"cannot start the trainer: {exc}")
            return Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR, f"Cannot start the trainer: {exc}",
                           log_lines=tuple(self.output.tail))
        self.proc = proc
        ident = processes.identity_of(proc.pid)
        # Reconcile needs these to kill a trainer whose supervisor died: kept until a write lands.
        self._pending_values = {"trainer_pid": proc.pid, "trainer_start_ticks": ident.start_ticks if ident else None}
        self._write()
        log.info("job %s: trainer group %s started", self.job_id, proc.pid)
        self._supervise(proc)
        self._ensure_gone(proc.pid)
        proc.stdout.close()  # type: ignore[union-attr]
        delay = 0.1
        while not self._flush(force=True):  # the last loss points land before the terminal state does
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        rc = sandbox.wait_status(proc.returncode, self.settings)  # the launcher's, through bwrap
        self.output.note(f"trainer ended: {processes.decode_wait_status(rc)}")
        return self._outcome(job, rc)

    def _supervise(self, proc: subprocess.Popen[bytes]) -> None:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        selector = selectors.DefaultSelector()
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        selector.register(proc.stdout.fileno(), selectors.EVENT_READ, STREAM)
        open_pipes, exited_at = 1, None
        try:
            while open_pipes or proc.poll() is None:
                started = time.monotonic()
                closed, backlog = self._read_ready(selector)
                open_pipes -= closed
                now = time.monotonic()
                if proc.poll() is not None and exited_at is None:
                    exited_at = now
                    if open_pipes and proc.returncode < 0:
                        # The launcher itself was killed; its trainer runs on orphaned and the run has
                        # failed already, so stop the rest now rather than let it hold the GPU.
                        status = processes.decode_wait_status(proc.returncode)
                        self._begin_stop("orphaned", f"the launcher was {status}")
                if exited_at is not None and open_pipes and now - exited_at > DRAIN_GRACE_S:
                    # accelerate waits for its trainer, so whatever still holds the pipes is a straggler.
                    self._kill_everything(proc.pid, signal.SIGKILL)
                self._tick(now)
                if not backlog:
                    # Let output gather in the pipe: one wake-up, read and parse per COALESCE_S instead of one
                    # per redraw. Nothing here must react faster; the ledger is written once a second.
                    time.sleep(max(0.0, COALESCE_S - (time.monotonic() - started)))
        finally:
            selector.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.output.end()

    def _read_ready(self, selector: selectors.BaseSelector) -> tuple[int, bool]:
        """Read what the pipe holds; (pipes that reached EOF, whether the trainer is writing a lot)."""
        closed, got = 0, 0
        for key, _ in selector.select(SELECT_TIMEOUT_S):
            try:
                data = os.read(key.fd, READ_BYTES)
            except BlockingIOError:
                continue
            if data:
                self.output.consume(data, time.monotonic())
                got += len(data)
            else:
                selector.unregister(key.fd)
                closed += 1
        return closed, got >= BUSY_BYTES

    def _on_output(self, phase: Phase, step: int) -> None:
        p = self.output.progress
        now = time.monotonic()
        if p.phase is not phase or p.step != step or p.phase is not Phase.TRAINING:
            # Any output counts as life in the quiet phases; in training only a new step does.
            self._activity_at = now
        self.clock.follow(p.phase, p.step, now)
        if p.phase is not phase:
            self._flush(force=True)

    # -- periodic work -----------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        self.output.tick(now)
        processes.reap_orphans(keep={self.proc.pid})
        if now - self._last_write >= self.settings.progress_interval_s:
            self._flush()
        if now - self._last_cancel_poll >= CANCEL_POLL_S:
            self._last_cancel_poll = now
            self._poll_cancel()
        if self._signalled is not None and self.stop_reason is None:
            self._begin_stop("signal", f"supervisor received {signal.Signals(self._signalled).name}")
        self._watchdog(now)
        if self._kill_at is not None and now >= self._kill_at and not self._killed_hard:
            self.output.note(f"grace of {self.settings.cancel_grace_s:g}s over; SIGKILL to the job's processes")
            self._kill_everything(self.proc.pid, signal.SIGKILL)
            self._killed_hard = True

    def _poll_cancel(self) -> None:
        try:
            status, cancel = repo.cancel_state(self.db, self.job_id)
        except TRANSIENT as exc:
            log.warning("job %s: cannot read the ledger (%s); will retry", self.job_id, exc)
            return
        if status != JobState.RUNNING.value:
            self._begin_stop("lost", "the job is no longer running in the ledger")
        elif cancel and self.stop_reason is None:
            self._begin_stop("cancel", "cancel requested")

    def _watchdog(self, now: float) -> None:
        phase = self.output.progress.phase
        limit = self.settings.stall_limits_s.get(phase.value)
        if self.stop_reason is None and limit is not None and now - self._activity_at > limit:
            self.stalled_in = phase.value
            self._begin_stop("stall", f"no progress in {phase.value} for {now - self._activity_at:.0f}s "
                                      f"(limit {limit:g}s)")

    def _begin_stop(self, reason: str, why: str) -> None:
        if self.stop_reason is not None:
            return
        if self.proc.poll() is not None and not processes.group_members(self.proc.pid):
            return  # it ended on its own; the natural outcome stands
        self.stop_reason = reason
        self.output.note(f"{why}; SIGTERM to process group {self.proc.pid}")
        log.info("job %s: %s; stopping the trainer", self.job_id, why)
        self._kill_everything(self.proc.pid, signal.SIGTERM)
        self._kill_at = time.monotonic() + self.settings.cancel_grace_s

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signalled = signum  # acted on by the loop, never here

    def _kill_everything(self, pgid: int, sig: int) -> None:
        # The group catches the launcher, the trainer and its workers; descendants catch a grandchild that
        # started its own session (we are their subreaper, so orphans are still ours).
        processes.signal_group(pgid, sig)
        processes.kill_all(processes.live_descendants(os.getpid()), sig)

    def _ensure_gone(self, pgid: int) -> None:
        """Return only when no process of the job is alive. A process that outlives SIGKILL (stuck in the
        driver, state D) still holds the GPU: the job stays active and the GPU lock held until it goes,
        rather than the ledger saying "every process is gone" while one is not."""
        patient_until = warn_at = time.monotonic() + 30.0
        while True:
            leftovers = processes.group_members(pgid) + [p.pid for p in processes.live_descendants(os.getpid())]
            processes.reap_orphans(keep=set())
            if not leftovers:
                return
            if time.monotonic() > warn_at:
                log.error("job %s: processes %s survive SIGKILL; waiting for them to go", self.job_id, leftovers)
                self.output.note(f"processes {leftovers} survive SIGKILL; the job ends when they are gone")
                warn_at = time.monotonic() + 300.0
            self._kill_everything(pgid, signal.SIGKILL)
            time.sleep(0.05 if time.monotonic() < patient_until else 1.0)  # each pass lists every process

    # -- the ledger --------------------------------------------------------------------------------------

    def _flush(self, force: bool = False) -> bool:
        """Write the progress if it changed and is due (or `force`); False if the ledger did not take it."""
        for step, loss in self.output.parser.take_points():
            self._pending_points[step] = loss
        if self.clock.moves():
            self.output.changed = True  # the ETA counts down with the clock, output or not
        pending = self.output.changed or self._pending_points or self._pending_values
        if not pending or (not force and not self._due()):
            return True
        p = self.output.progress
        at = utcnow()
        eta, basis = self.clock.eta(p.phase, now=time.monotonic(), elapsed_s=time.monotonic() - self._started)
        values = {
            "phase": p.phase.value, "step": p.step, "loss": _finite(p.loss), "rate": self.clock.rate() or p.rate,
            "eta_s": eta, "eta_basis": basis, "last_progress_at": at,
        }
        if p.total_steps:
            values["total_steps"] = p.total_steps
        if p.phase is Phase.TRAINING and self._training_at is None:
            self._training_at = at  # when the steps bar first showed; written with every flush after
        if self._training_at is not None:
            values["training_started_at"] = self._training_at
        points = [(step, _finite(loss), at) for step, loss in sorted(self._pending_points.items())]
        if not self._write(points=points, **values):
            return False
        self._pending_points.clear()
        self.output.changed = False
        return True

    def _due(self) -> bool:
        return time.monotonic() - self._last_write >= self.settings.progress_interval_s

    def _write(self, points: list[tuple[int, float | None, datetime]] | None = None, **values: object) -> bool:
        self._last_write = time.monotonic()
        try:
            if not repo.update_running(self.db, self.job_id, points=points or (), **self._pending_values, **values):
                self._begin_stop("lost", "the job is no longer running in the ledger")
            self._pending_values = {}
            return True
        except TRANSIENT as exc:
            # Progress can wait; the trainer must not. Kept in memory and written at the next tick.
            log.warning("job %s: progress not written (%s); will retry", self.job_id, exc)
            return False

    def _outcome(self, job: Job, rc: int | None) -> Outcome:
        cancelled = self.stop_reason in ("cancel", "signal")
        artifact: ArtifactCheck | None = None
        if rc == 0 and not self.stop_reason and "model_saved" in self.output.progress.flags:
            artifact = verify_lora(Path(job.lora_file), recorded_lora(job))
            if artifact.problem is None:
                self.artifact_values = self._artifact_values(artifact)
        return decide(returncode=rc, progress=self.output.progress, log_tail=self.output.tail,
                      cancelled=cancelled, stalled_in=self.stalled_in, artifact=artifact)

    def _finish(self, outcome: Outcome) -> None:
        p = self.output.progress
        values: dict[str, object] = {
            "exit_code": outcome.exit_code, "signal": outcome.signal, "lora_path": outcome.lora_path,
            "step": p.step, "loss": _finite(p.loss),
            "eta_s": None, "eta_basis": None,  # nothing is left to wait for, whatever the outcome
        }

        def write() -> bool:
            if outcome.state is JobState.SUCCEEDED:
                return repo.transition(self.db, self.job_id, JobState.SUCCEEDED, actor="supervisor",
                                       reason="trainer finished and the LoRA verified",
                                       **values, **self.artifact_values)
            if outcome.state is JobState.CANCELLED:
                return repo.transition(self.db, self.job_id, JobState.CANCELLED, actor="supervisor",
                                       reason="cancelled; every process of the job is gone", **values)
            return repo.fail_job(self.db, self.job_id, actor="supervisor",
                                 failure_class=outcome.failure_class or FailureClass.SUPERVISOR_LOST,
                                 sentence=outcome.sentence or "The run failed", log_lines=outcome.log_lines,
                                 **values)

        # The outcome is known and must not be lost: keep trying, holding the job lock meanwhile.
        if not _persist(write, f"job {self.job_id}: write the final state"):
            log.warning("job %s: already ended elsewhere; %s not recorded", self.job_id, outcome.state.value)
        log.info("job %s: %s%s", self.job_id, outcome.state.value,
                 f" ({outcome.failure_class.value})" if outcome.failure_class else "")

    def _artifact_values(self, artifact: ArtifactCheck) -> dict[str, object]:
        """The verified file's hash and size, and what its metadata adds to the fingerprint."""
        values: dict[str, object] = {"lora_sha256": artifact.sha256, "lora_size": artifact.size}
        md = artifact.metadata
        if md.get("ss_new_sd_model_hash"):
            values["base_model_sha256"] = md["ss_new_sd_model_hash"]
        commit = md.get("ss_sd_scripts_commit_hash", "")
        if not self.job.sd_scripts_commit and SHA.match(commit):
            values["sd_scripts_commit"] = commit  # no .git in the checkout; sd-scripts knew its own commit
        return values


def _persist(write: Callable[[], T], what: str) -> T:
    """Run a ledger call until the ledger takes it: a locked or full database is waited out, not fatal.
    Meanwhile the job lock stays held, so reconcile never takes the job for dead."""
    delay = 0.1
    while True:
        try:
            return write()
        except TRANSIENT as exc:
            log.warning("%s: ledger unavailable (%s); retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) or math.isinf(value) else value



"""One poller cycle: every active Slurm row of the ledger, brought up to date with what Slurm and the job's
log say. The poller process (process.py) runs it every `slurm_poll_interval_s`.

Per cycle: one `squeue` for all the jobs, one `sacct` for those squeue shows ended or no longer knows
(`scontrol show job` if slurmdbd does not answer), one read of each job's new log bytes, and a ledger write
only where something changed. Nothing is kept that the ledger and the files do not hold: a restarted poller
re-reads each job's log from its start (the same parser, so the same phase, step and loss points), and a run
log it finds is moved aside and written again in full (transcript/logfile.py keeps the old one).

- PENDING: the row stays `queued`, with Slurm's reason in `queue_reason`.
- RUNNING: the row becomes `running` (once), then carries phase, step, loss, rate and ETA from the log.
- ended: the row's terminal state is `states.settle`'s, written once the ending has settled: the trainer's
  `.rc` file is there, or one more cycle has passed (a CANCELLED job's ExitCode reads `0:0` first).
- known to no command for UNKNOWN_CYCLES cycles in a row (each of them answering): `settle` with nothing.
- a cancel the API flagged: a pending job gets a plain `scancel`; a running one `scancel --signal=TERM --full`,
  then `--signal=KILL --full` after `cancel_grace_s`. The row becomes `cancelled` once Slurm says it ended.
- a running job Slurm shows pending again was requeued (--no-requeue should prevent it): a second run under
  the same id is refused, the job is scancelled and ends `failed` (node_fail).
- a running job silent past its phase's stall limit (the supervisor's Watchdog, counted from when the poller
  first saw it run) is stopped the same way and ends `failed` (stalled).
A command that does not answer changes nothing this cycle: silence is never taken for an ending.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.host.fs import open_regular
from lora_worker.host.safetensors import ArtifactCheck, verify_lora
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job, utcnow
from lora_worker.transcript.eta import EtaClock
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.outcome import Outcome, artifact_values, recorded_lora
from lora_worker.transcript.output import TrainerOutput
from lora_worker.transcript.persist import TRANSIENT
from lora_worker.run.reporter import finite
from lora_worker.slurm.sbatch import log_path, rc_path, refused_outcome
from lora_worker.slurm.scheduler import Scheduler, SchedulerUnavailable, SlurmJob
from lora_worker.slurm.states import settle, stage
from lora_worker.transcript.watchdog import Watchdog
from lora_worker.states import FailureClass, JobState, Phase

log = logging.getLogger(__name__)

UNKNOWN_CYCLES = 3  # answered cycles in a row in which no command knows a job, before it counts as lost
READ_CAP = 8 << 20  # log bytes taken per job per cycle: a flood is read over a few cycles, not at once
RC_MAX_BYTES = 64


@dataclass
class Followed:
    """What the poller keeps of one job between cycles (all of it rebuilt from files after a restart)."""

    job: Job
    output: TrainerOutput
    clock: EtaClock
    attached_at: float
    log_fd: int | None = None
    unknown_cycles: int = 0
    ended_cycles: int = 0
    cancel_pending_sent: bool = False
    term_sent_at: float | None = None
    kill_sent: bool = False
    requeued: bool = False  # seen pending again after it ran
    watchdog: Watchdog | None = None  # from the first cycle that sees the job run
    final: tuple[Outcome, dict[str, object]] | None = None  # the outcome, once decided
    training_at: datetime | None = None
    points: dict[int, float | None] = field(default_factory=dict)


class Poller:
    def __init__(self, settings: Settings, db: Database, scheduler: Scheduler,
                 monotonic: Callable[[], float]) -> None:
        self.settings = settings
        self.db = db
        self.scheduler = scheduler
        self.monotonic = monotonic
        self.followed: dict[int, Followed] = {}

    # -- the cycle --------------------------------------------------------------------------------------

    def cycle(self) -> None:
        try:
            jobs = [j for j in repo.active_jobs(self.db) if j.backend == "slurm"]
        except TRANSIENT as exc:
            log.warning("slurm poller: ledger unavailable (%s); next cycle", exc)
            return
        for job_id in set(self.followed) - {j.id for j in jobs}:
            self._forget(job_id)  # ended elsewhere (reconcile, an operator)
        ids = {j.slurm_job_id for j in jobs if j.slurm_job_id}
        try:
            live = self.scheduler.queue(ids)
        except SchedulerUnavailable as exc:
            log.warning("slurm poller: squeue did not answer (%s); next cycle", exc)
            return
        gone = {i for i in ids if stage(live.get(i)) in ("ended", "unknown")}
        ended, answered = self._accounting(gone)
        for job in jobs:
            sid = job.slurm_job_id
            # squeue alone says what is live: a job it does not list is not, whatever sacct's record says
            # (slurmdbd keeps RUNNING for a job slurmctld lost). sacct says how a job ended.
            record = ended.get(sid) if sid else None
            if record is not None and stage(record) != "ended":
                record = None
            known = (record or live.get(sid)) if sid else None
            try:
                self.follow(job, known, answered=answered or (sid in live))
            except TRANSIENT as exc:
                log.warning("job %s: ledger unavailable (%s); next cycle", job.id, exc)
            except SchedulerUnavailable as exc:
                log.warning("job %s: Slurm did not answer (%s); next cycle", job.id, exc)
            except Exception:  # one job's trouble (a bug, an unreadable file) must not starve the others
                log.exception("job %s: poller error; next cycle", job.id)

    def _accounting(self, ids: set[str]) -> tuple[dict[str, SlurmJob], bool]:
        if not ids:
            return {}, True
        try:
            return self.scheduler.accounting(ids), True
        except SchedulerUnavailable as exc:
            log.info("slurm poller: sacct did not answer (%s); asking scontrol", exc)
        found: dict[str, SlurmJob] = {}
        try:
            for sid in ids:
                if (job := self.scheduler.show(sid)) is not None:
                    found[sid] = job
        except SchedulerUnavailable:
            return found, False
        return found, True

    def follow(self, job: Job, known: SlurmJob | None, *, answered: bool) -> None:
        now = self.monotonic()
        f = self.followed.get(job.id)
        if f is None:
            f = self.followed[job.id] = self._attach(job, now)
        f.job = job
        if job.slurm_job_id is None:
            self._unsubmitted(job)
            return
        if f.final is None:
            self._read_log(f, now)
        where = stage(known)
        if f.final is not None:  # decided already; only its write is left
            self._finish(f, known)
            return
        if where == "running" and f.watchdog is None:
            f.watchdog = Watchdog(self.settings.stall_limits_s, now)
        if where == "running" and f.watchdog.stalled_in is None and job.cancel_requested_at is None \
                and (why := f.watchdog.check(f.output.progress.phase, now)):
            f.output.note(f"stalled: {why}; stopping Slurm job {job.slurm_job_id}")
        if where == "pending" and job.status == JobState.RUNNING.value and not f.requeued:
            f.requeued = True
            f.output.note(f"Slurm requeued job {job.slurm_job_id} ({known.detail if known else '?'}); stopping it")
        stalled = f.watchdog is not None and f.watchdog.stalled_in is not None
        if (job.cancel_requested_at is not None or stalled or f.requeued) and where in ("pending", "running"):
            self._cancel(f, where, now)
        if where == "pending":
            f.unknown_cycles = f.ended_cycles = 0
            if job.status == JobState.QUEUED.value and job.queue_reason != (known.reason if known else None):
                repo.record_queue_reason(self.db, job.id, known.reason if known else None)
        elif where == "running":
            f.unknown_cycles = f.ended_cycles = 0
            if job.status == JobState.QUEUED.value:
                self._started(job)
            self._report(f, now)
        elif where == "ended":
            f.ended_cycles += 1
            if self._recorded_status(job) is not None or f.ended_cycles > 1:
                self._finish(f, known)
        elif answered:
            f.unknown_cycles += 1
            if f.unknown_cycles >= UNKNOWN_CYCLES:
                self._finish(f, None)

    # -- the stages -------------------------------------------------------------------------------------

    def _attach(self, job: Job, now: float) -> Followed:
        s = self.settings
        joblog = JobLog(s.log_dir, job.id, head_bytes=s.log_head_bytes, tail_bytes=s.log_tail_bytes)
        output = TrainerOutput(joblog, lambda phase, step: self._saw_output(job.id, phase, step))
        output.note(f"job {job.id} on Slurm (job {job.slurm_job_id or 'not submitted yet'}); its output as the "
                    f"node wrote it: {log_path(s, job.id)}")
        clock = EtaClock(job.total_steps, estimated_duration_s=job.estimated_duration_s)
        return Followed(job, output, clock, now)

    def _saw_output(self, job_id: int, phase: Phase, step: int) -> None:
        f = self.followed.get(job_id)
        if f is not None and f.watchdog is not None:
            f.watchdog.saw_output(phase, step, f.output.progress, self.monotonic())

    def _unsubmitted(self, job: Job) -> None:
        """A queued row without a Slurm id: dispatch is submitting it, or died doing so."""
        if utcnow() - job.created_at < timedelta(seconds=self.settings.launch_grace_s):
            return
        if repo.fail_job(self.db, job.id, actor="slurm", failure_class=FailureClass.LAUNCH_ERROR,
                         sentence="The submission to Slurm never completed (no Slurm job id was recorded)"):
            self._forget(job.id)

    def _started(self, job: Job) -> bool:
        return repo.transition(self.db, job.id, JobState.RUNNING, actor="slurm", reason="Slurm started the job",
                               started_at=utcnow(), phase=Phase.LAUNCHING.value, queue_reason=None)

    def _cancel(self, f: Followed, where: str, now: float) -> None:
        sid = f.job.slurm_job_id
        assert sid is not None
        if where == "pending":
            if not f.cancel_pending_sent:
                self.scheduler.cancel(sid)
                f.cancel_pending_sent = True
                f.output.note("stopping: scancel of the pending Slurm job")
            return
        if f.term_sent_at is None:
            self.scheduler.cancel(sid, "TERM")
            f.term_sent_at = now
            f.output.note(f"stopping: SIGTERM to every process of Slurm job {sid}")
        elif not f.kill_sent and now - f.term_sent_at >= self.settings.cancel_grace_s:
            self.scheduler.cancel(sid, "KILL")
            f.kill_sent = True
            f.output.note(f"still running {self.settings.cancel_grace_s:g}s after SIGTERM: SIGKILL")

    def _read_log(self, f: Followed, now: float) -> None:
        if f.log_fd is None:
            try:
                f.log_fd, _ = open_regular(None, str(log_path(self.settings, f.job.id)))
            except FileNotFoundError:
                return
            except OSError as exc:  # a link or a FIFO planted under its name: never followed, never read
                log.warning("job %s: cannot open its Slurm log (%s)", f.job.id, exc)
                return
        taken = 0
        while taken < READ_CAP and (data := os.read(f.log_fd, min(1 << 20, READ_CAP - taken))):
            taken += len(data)
            f.output.consume(data, now)
        f.output.tick(now)
        p = f.output.progress
        f.clock.follow(p.phase, p.step, now)

    def _report(self, f: Followed, now: float) -> None:
        for step, loss in f.output.parser.take_points():
            f.points[step] = loss
        if not (f.output.changed or f.points or f.clock.moves()):
            return
        at = utcnow()
        p = f.output.progress
        eta, basis = f.clock.eta(p.phase, now=now, elapsed_s=now - f.attached_at)
        values: dict[str, object] = {"phase": p.phase.value, "step": p.step, "loss": finite(p.loss),
                                     "rate": f.clock.rate() or p.rate, "eta_s": eta, "eta_basis": basis,
                                     "last_progress_at": at}
        if p.total_steps:
            values["total_steps"] = p.total_steps
        if p.phase is Phase.TRAINING and f.training_at is None:
            f.training_at = at
        if f.training_at is not None:
            values["training_started_at"] = f.training_at
        points = [(step, finite(loss), at) for step, loss in sorted(f.points.items())]
        repo.update_running(self.db, f.job.id, points=points, **values)
        f.points.clear()
        f.output.changed = False

    def _recorded_status(self, job: Job) -> int | None:
        """The trainer's return code as the batch script recorded it, None if it did not (or not yet)."""
        try:
            fd, _ = open_regular(None, str(rc_path(self.settings, job.id)))  # no link, no FIFO: never waited on
        except OSError:
            return None
        try:
            text = os.read(fd, RC_MAX_BYTES).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        try:
            return int(text)
        except ValueError:
            return None

    def _finish(self, f: Followed, known: SlurmJob | None) -> None:
        job = f.job
        if f.final is None:  # decided once; a write the ledger refused is retried next cycle, as decided
            self._read_log(f, self.monotonic())
            f.output.end()
            recorded = self._recorded_status(job)
            artifact: list[ArtifactCheck] = []

            def verify() -> ArtifactCheck:
                artifact.append(verify_lora(Path(job.lora_file), recorded_lora(job)))  # held to the row
                return artifact[-1]

            refused = refused_outcome(self.settings, job.id, f.output.tail)  # the node's pre-exec look said no
            outcome = refused or settle(known, slurm_job_id=job.slurm_job_id or "?", recorded=recorded,
                             cancel_requested=job.cancel_requested_at is not None,
                             stalled_in=f.watchdog.stalled_in if f.watchdog else None, requeued=f.requeued,
                             progress=f.output.progress,
                             log_tail=f.output.tail, verify=verify)
            extra = artifact_values(artifact[-1], recorded_commit=job.sd_scripts_commit) if artifact and outcome.state is JobState.SUCCEEDED else {}
            f.output.note(f"Slurm job {job.slurm_job_id}: {known.detail if known else 'unknown to Slurm'}; "
                          f"recorded return code {recorded}; the job is {outcome.state.value}"
                          + (f" ({outcome.failure_class.value})" if outcome.failure_class else ""))
            f.final = (outcome, extra)
        outcome, extra = f.final
        running = job.status == JobState.RUNNING.value
        if not running and outcome.state is not JobState.CANCELLED:
            running = self._started(job)  # it ran between two cycles: a terminal state comes through `running`
        if self._write_final(job, outcome, f, extra, running=running):
            log.info("job %s: %s%s", job.id, outcome.state.value,
                     f" ({outcome.failure_class.value})" if outcome.failure_class else "")
        self._forget(job.id)

    def _write_final(self, job: Job, outcome: Outcome, f: Followed, extra: dict[str, object], *,
                     running: bool) -> bool:
        p = f.output.progress
        for step, loss in f.output.parser.take_points():
            f.points[step] = loss
        if f.points and running:  # the last loss points land before the terminal state does
            at = utcnow()
            repo.update_running(self.db, job.id, points=[(s, finite(v), at) for s, v in sorted(f.points.items())])
        values: dict[str, object] = {"exit_code": outcome.exit_code, "signal": outcome.signal,
                                     "lora_path": outcome.lora_path, "step": p.step, "loss": finite(p.loss),
                                     "queue_reason": None}
        if running:  # the phase it ended in (saving after a success), though it ended between two polls
            values["phase"] = p.phase.value
        if outcome.state is JobState.SUCCEEDED:
            return repo.transition(self.db, job.id, JobState.SUCCEEDED, actor="slurm",
                                   reason="Slurm job completed and the LoRA verified", **values, **extra)
        if outcome.state is JobState.CANCELLED:
            return repo.transition(self.db, job.id, JobState.CANCELLED, actor="slurm",
                                   reason="cancelled; Slurm says the job ended", **values)
        return repo.fail_job(self.db, job.id, actor="slurm",
                             failure_class=outcome.failure_class or FailureClass.SLURM_LOST,
                             sentence=outcome.sentence or "The Slurm job failed", log_lines=outcome.log_lines,
                             **values)

    def _forget(self, job_id: int) -> None:
        f = self.followed.pop(job_id, None)
        if f is None:
            return
        if f.log_fd is not None:
            os.close(f.log_fd)
        f.output.joblog.close()

    def close(self) -> None:
        for job_id in list(self.followed):
            self._forget(job_id)

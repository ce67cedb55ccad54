"""One poller cycle: every active Slurm row of the ledger, brought up to date with what Slurm and the job's
log say. The poller process (process.py) runs it every `slurm_poll_interval_s`; each job's own rules are its
SlurmRun's (job.py).

Per cycle: one `squeue` for all the jobs, one `sacct` for those squeue shows ended or does not list
(`scontrol show job` if slurmdbd does not answer: a record it shows counts, its "Invalid job id" does not), one
read of each job's new log bytes, and a ledger write only where something changed. A command that does not
answer changes nothing this cycle: silence is never taken for an ending. Nothing is kept that the ledger and
the files do not hold: a restarted poller takes up each job where the row and the node's log say it is, and
appends to its run log. A row that ended elsewhere (reconcile, an operator) while Slurm may still run its job
gets the job scancelled.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lora_worker.config import Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job
from lora_worker.slurm.job import UNKNOWN_CYCLES, SlurmRun
from lora_worker.slurm.ledger import SlurmLedger
from lora_worker.slurm.scheduler import Scheduler, SchedulerUnavailable, SlurmJob
from lora_worker.slurm.states import Stage, stage
from lora_worker.transcript.persist import TRANSIENT

__all__ = ["Poller", "UNKNOWN_CYCLES"]

log = logging.getLogger(__name__)
BACKEND = "slurm"  # the rows this poller follows (the ledger's `backend` column)


@dataclass(frozen=True)
class Answers:
    """One cycle's answers: squeue's listing, accounting's records, and the ids accounting answered for."""

    live: dict[str, SlurmJob]
    records: dict[str, SlurmJob]
    answered: set[str]

    def of(self, sid: str | None) -> tuple[SlurmJob | None, bool]:
        """What is known of the job, and whether Slurm answered for it. squeue alone says what is live: a job
        it does not list is not, whatever sacct's record says (slurmdbd keeps RUNNING for a job slurmctld
        lost); sacct says how a job ended."""
        if sid is None:
            return None, False
        record = self.records.get(sid)
        if record is not None and stage(record) is not Stage.ENDED:
            record = None
        return record or self.live.get(sid), sid in self.live or sid in self.answered


class Poller:
    def __init__(self, settings: Settings, db: Database, scheduler: Scheduler, monotonic: Callable[[], float],
                 beat: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self.db = db
        self.ledger = SlurmLedger(db)
        self.scheduler = scheduler
        self.monotonic = monotonic
        self.beat = beat  # the heartbeat `attended` checks: a poller stuck in a read is noticed and replaced
        self.runs: dict[int, SlurmRun] = {}

    def cycle(self) -> None:
        self.beat()
        try:
            jobs = [j for j in repo.active_jobs(self.db) if j.backend == BACKEND]
        except TRANSIENT as exc:
            log.warning("slurm poller: ledger unavailable (%s); next cycle", exc)
            return
        self._drop_ended_elsewhere({j.id for j in jobs})
        try:
            answers = self._ask({j.slurm_job_id for j in jobs if j.slurm_job_id})
        except SchedulerUnavailable as exc:
            log.warning("slurm poller: squeue did not answer (%s); next cycle", exc)
            return
        for job in jobs:
            known, answered = answers.of(job.slurm_job_id)
            self._follow(job, known, answered=answered)
            self.beat()

    def _ask(self, ids: set[str]) -> Answers:
        live = self.scheduler.queue(ids)
        records, answered = self._accounting({i for i in ids if stage(live.get(i)) in (Stage.ENDED, Stage.UNLISTED)})
        return Answers(live, records, answered)

    def _accounting(self, ids: set[str]) -> tuple[dict[str, SlurmJob], set[str]]:
        """What accounting says of these jobs, and which of them it answered for."""
        if not ids:
            return {}, set()
        try:
            return self.scheduler.accounting(ids), set(ids)
        except SchedulerUnavailable as exc:
            log.info("slurm poller: sacct did not answer (%s); asking scontrol", exc)
        found: dict[str, SlurmJob] = {}
        for sid in ids:
            try:
                job = self.scheduler.show(sid)
            except SchedulerUnavailable:
                break
            if job is not None:  # "Invalid job id" is slurmctld's memory running out, not how the job ended
                found[sid] = job
        return found, set(found)

    def _follow(self, job: Job, known: SlurmJob | None, *, answered: bool) -> None:
        run = self.runs.get(job.id)
        try:
            if run is None:
                run = self.runs[job.id] = SlurmRun(job, self.settings, self.ledger, self.scheduler, self.monotonic)
            done = run.observe(job, known, answered=answered)
        except TRANSIENT as exc:
            log.warning("job %s: ledger unavailable (%s); next cycle", job.id, exc)
            return
        except SchedulerUnavailable as exc:
            log.warning("job %s: Slurm did not answer (%s); next cycle", job.id, exc)
            return
        except Exception:  # one job's trouble (a bug, an unreadable file) must not starve the others
            log.exception("job %s: poller error; next cycle", job.id)
            return
        if done:
            self._forget(job.id)

    def _drop_ended_elsewhere(self, active: Iterable[int]) -> None:
        for job_id in set(self.runs) - set(active):
            try:
                self.runs[job_id].abandon()
            except SchedulerUnavailable as exc:
                log.warning("job %s: ended elsewhere; scancel did not answer (%s)", job_id, exc)
                continue  # asked again next cycle
            self._forget(job_id)

    def _forget(self, job_id: int) -> None:
        run = self.runs.pop(job_id, None)
        if run is not None:
            run.close()

    def close(self) -> None:
        for job_id in list(self.runs):
            self._forget(job_id)

"""Retention: forget finished jobs older than a cutoff, with their events, loss curve and run logs.

Never an active job (the delete itself re-checks the state), and never a file outside the worker's log
directory: a trained LoRA belongs to the client and stays where it is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import utcnow
from lora_worker.transcript.logfile import log_paths

log = logging.getLogger(__name__)

DELETE_BATCH = 500  # rows per transaction: the supervisor's progress writes never wait long


@dataclass(frozen=True)
class Pruned:
    cutoff: datetime
    job_ids: list[int]
    log_files: list[Path]


def prune(db: Database, settings: Settings, *, older_than_days: float, now: datetime | None = None,
          dry_run: bool = False) -> Pruned:
    """Remove jobs that finished more than `older_than_days` ago. Logs go first, rows second, so a prune that
    is interrupted leaves rows whose logs are gone, and the next prune finishes the work."""
    cutoff = (now or utcnow()) - timedelta(days=older_than_days)
    job_ids = repo.finished_before(db, cutoff)
    removed = []
    for job_id in job_ids:
        for path in log_paths(settings.log_dir, job_id):
            if path.exists():
                if not dry_run:
                    path.unlink(missing_ok=True)
                removed.append(path)
    if not dry_run:
        for start in range(0, len(job_ids), DELETE_BATCH):
            repo.delete_jobs(db, job_ids[start:start + DELETE_BATCH])
        for job_id in job_ids:
            log.info("job %s pruned (finished before %s)", job_id, cutoff.isoformat(), extra={"job": job_id})
    return Pruned(cutoff, job_ids, removed)

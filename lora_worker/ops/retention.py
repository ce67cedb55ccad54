"""Retention: forget finished jobs older than a cutoff, with their events, loss curve and run logs.

Never an active job (the delete itself re-checks the state), and never a finished LoRA: a trained LoRA belongs
to the client and stays where it is. What goes with a job is what the worker itself made for it: its run log
(head and tail, and any log moved aside as `.replaced-…`), its job lock file (unless someone holds it), and a
partial LoRA its follower moved aside (`<name>.partial-<job_id>`, transcript/partial.py). That last one lies in the
train root, which another party writes: the output dir is opened without following a link and held to the
identity dispatch recorded, and only a regular file of that exact name is removed, through that descriptor.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.host import fs
from lora_worker.host.flock import take_lock
from lora_worker.host.locks import job_lock_path
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import utcnow
from lora_worker.transcript.logfile import log_paths

log = logging.getLogger(__name__)

DELETE_BATCH = 500  # rows per transaction: the supervisor's progress writes never wait long
PARTIAL = ".partial-"  # transcript/partial.py's name for a LoRA moved aside


@dataclass(frozen=True)
class Pruned:
    cutoff: datetime
    job_ids: list[int]
    log_files: list[Path]
    other_files: list[str] = field(default_factory=list)  # job lock files, partial LoRAs moved aside


def prune(db: Database, settings: Settings, *, older_than_days: float, now: datetime | None = None,
          dry_run: bool = False) -> Pruned:
    """Remove jobs that finished more than `older_than_days` ago. Files go first, rows second, so a prune that
    is interrupted leaves rows whose files are gone, and the next prune finishes the work."""
    cutoff = (now or utcnow()) - timedelta(days=older_than_days)
    job_ids = repo.finished_before(db, cutoff)
    replaced = _replaced_logs(settings.log_dir)
    removed: list[Path] = []
    others: list[str] = []
    for job_id in job_ids:
        removed += _logs(settings.log_dir, job_id, replaced, dry_run)
        others += _lock_file(job_lock_path(settings, job_id), dry_run)
        job = repo.get_job(db, job_id)
        if job is not None and job.output_dir and job.lora_file:
            others += _partial_lora(job.output_dir, job.output_dev_ino, os.path.basename(job.lora_file), job_id,
                                    dry_run)
    if not dry_run:
        for start in range(0, len(job_ids), DELETE_BATCH):
            repo.delete_jobs(db, job_ids[start:start + DELETE_BATCH])
        for job_id in job_ids:
            log.info("job %s pruned (finished before %s)", job_id, cutoff.isoformat(), extra={"job": job_id})
    return Pruned(cutoff, job_ids, removed, others)


def _logs(log_dir: Path, job_id: int, replaced: dict[str, list[Path]], dry_run: bool) -> list[Path]:
    removed = []
    for path in log_paths(log_dir, job_id):
        for found in ([path] if path.exists() else []) + replaced.get(path.name, []):
            if not dry_run:
                found.unlink(missing_ok=True)
            removed.append(found)
    return removed


def _replaced_logs(log_dir: Path) -> dict[str, list[Path]]:
    """Logs moved aside (`job-N.log.replaced-<ns>`, transcript/logfile.py), by the name they had: one listing."""
    found: dict[str, list[Path]] = {}
    try:
        names = os.listdir(log_dir)
    except FileNotFoundError:
        return found
    for name in names:
        base, sep, _ = name.partition(".replaced-")
        if sep:
            found.setdefault(base, []).append(log_dir / name)
    return found


def _lock_file(path: Path, dry_run: bool) -> list[str]:
    """The job's lock file, removed only while nobody holds it (we hold it meanwhile)."""
    if not os.path.lexists(path):
        return []  # taking the lock would create it
    try:
        fd = take_lock(path, 0.0)
    except OSError:
        return []
    if fd is None:
        return []
    try:
        if not dry_run:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
    return [str(path)]


def _partial_lora(output_dir: str, recorded: str | None, lora_name: str, job_id: int, dry_run: bool) -> list[str]:
    if recorded is None:
        return []  # no identity to hold the directory to: nothing there is removed
    aside = f"{lora_name}{PARTIAL}{job_id}"
    try:
        fd = fs.open_dir(output_dir)
    except OSError:
        return []
    try:
        if fs.FileId.of(os.fstat(fd)) != fs.FileId.parse(recorded):
            return []
        gone = []
        for name, st in fs.list_entries(fd):
            if (name == aside or name.startswith(aside + "-")) and stat.S_ISREG(st.st_mode):
                if not dry_run:
                    os.unlink(name, dir_fd=fd)
                gone.append(os.path.join(output_dir, name))
        return gone
    finally:
        os.close(fd)

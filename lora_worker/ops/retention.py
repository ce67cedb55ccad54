"""Retention: forget finished jobs older than a cutoff, with their events, loss curve and run logs.

Never an active job (the delete itself re-checks the state), and never a finished LoRA: a trained LoRA belongs
to the client and stays where it is. What goes with a job is what the worker itself made for it: its run log
(head and tail, and any log moved aside as `.replaced-…`), its job lock file (unless someone holds it), and a
partial LoRA its follower moved aside (`<name>.partial-<job_id>`, transcript/partial.py). That last one lies in the
train root, which another party writes: the output dir is opened without following a link and held to the
identity dispatch recorded, and only a regular file of that exact name is removed, through that descriptor. So are
the saved states it left for a resume (`<name>-step<N>-state/`, `<name>-state/`; host/train_state.py), unless a kept
job writes the same LoRA file (a resume of it, which shares them).
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
from lora_worker.dispatch.presentation import DATASETS
from lora_worker.host.dataset_config import config_path_of
from lora_worker.host.train_state import remove_states
from lora_worker.ledger import repository as repo
from lora_worker.ledger import resumes
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
    other_files: list[str] = field(default_factory=list)  # job lock files, partial LoRAs moved aside, states


def prune(db: Database, settings: Settings, *, older_than_days: float, now: datetime | None = None,
          dry_run: bool = False) -> Pruned:
    """Remove jobs that finished more than `older_than_days` ago. Files go first, rows second, so a prune that
    is interrupted leaves rows whose files are gone, and the next prune finishes the work."""
    cutoff = (now or utcnow()) - timedelta(days=older_than_days)
    job_ids = repo.finished_before(db, cutoff)
    replaced = _replaced_logs(settings.log_dir)
    removed: list[Path] = []
    others: list[str] = []
    kept = resumes.lora_files_kept(db, cutoff) if job_ids else set()
    for job_id in job_ids:
        removed += _logs(settings.log_dir, job_id, replaced, dry_run)
        others += _lock_file(job_lock_path(settings, job_id), dry_run)
        job = repo.get_job(db, job_id)
        if job is not None and job.output_dir and job.lora_file:
            others += _partial_lora(job.output_dir, job.output_dev_ino, os.path.basename(job.lora_file), job_id,
                                    dry_run)
            if job.lora_file not in kept:
                others += _states(job.output_dir, job.output_name, job.output_dev_ino, dry_run)
    others += _dataset_configs(settings, db, cutoff, dry_run)
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


def _dataset_configs(settings: Settings, db: Database, cutoff: datetime, dry_run: bool) -> list[str]:
    """The dataset configs (dispatch/presentation.py) no launch has named since `cutoff` (each launch writes its
    own again, so a file's mtime is its last) and no active job names: a resume of an old job writes its config
    again. In the worker's own directories: the state dir's, and the Slurm log dir's."""
    named = {config_path_of(job.argv) for job in repo.active_jobs(db)}
    gone = []
    for directory in dict.fromkeys((settings.state_dir / DATASETS, settings.slurm_logs / DATASETS)):
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            path = str(directory / entry.name)
            if _written_before(entry, cutoff) and path not in named:
                if not dry_run:
                    Path(path).unlink(missing_ok=True)
                gone.append(path)
    return gone


def _written_before(entry: os.DirEntry[str], cutoff: datetime) -> bool:
    try:
        return entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff.timestamp()
    except OSError:
        return False  # gone meanwhile


def _states(output_dir: str, output_name: str, recorded: str | None, dry_run: bool) -> list[str]:
    """The saved states a job left for a resume nobody asked for (host/train_state.py: no link followed), in the
    output directory that is still the one dispatch recorded; never those of a job kept (`lora_files_kept`)."""
    if recorded is None:
        return []
    try:
        names = remove_states(output_dir, output_name, recorded, dry_run=dry_run)
    except OSError:
        return []  # gone, or not ours to walk: nothing of it is removed
    return [os.path.join(output_dir, name) for name in names]


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

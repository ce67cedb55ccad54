"""The worker's operations, one function per thing a client can ask. Views call these and nothing else.

Dispatch checks everything before it writes anything: a refused request leaves no row, no directory and no
process behind. Only a launch that fails after the INSERT (the output directory or the supervisor could not
be made) leaves a row, `failed` with `launch_error`, so the attempt is on record.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy.exc

from lora_worker.config import TIERS, Settings
from lora_worker.errors import (IdempotencyKeyReused, JobActive, JobNotFound, LaunchFailed, NvmlUnavailable,
                                OutputExists)
from lora_worker.fingerprint import sd_scripts_commit, trainer_versions
from lora_worker.gpu.admission import admit
from lora_worker.gpu.nvml import Nvml
from lora_worker.gpu.status import gpu_status
from lora_worker.invocation import paths
from lora_worker.invocation.builder import build_argv, build_env
from lora_worker.invocation.request import TrainRequest, check_device
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job, ProgressPoint, utcnow
from lora_worker.ledger.reconcile import current_job, reconcile
from lora_worker.ledger.states import FailureClass, JobState
from lora_worker.preflight.dataset import DatasetManifest, inspect_dataset
from lora_worker.preflight.disk import require_free_space
from lora_worker.preflight.model import check_base_model
from lora_worker.preflight.trainer import require_trainer
from lora_worker.progress.eta import estimate_duration
from lora_worker.progress.logfile import LogChunk, LogReader

log = logging.getLogger(__name__)

MAX_JOB_ID = 2**63 - 1  # SQLite's INTEGER; anything larger cannot name a job
LONG_POLL_INTERVAL_S = 0.2


@dataclass
class Worker:
    """What every operation needs: settings, the ledger, NVML, and how to start a supervisor."""

    settings: Settings
    db: Database
    nvml: Nvml
    launch: Callable[[int, Settings], None]

    def __post_init__(self) -> None:
        self._long_polls = threading.BoundedSemaphore(self.settings.long_poll_slots)

    # -- dispatch ----------------------------------------------------------------------------------------

    def submit(self, request: TrainRequest, *, idempotency_key: str | None = None,
               body_sha256: str | None = None) -> tuple[Job, bool]:
        """Validate, admit, record and launch a job; every refusal happens before the INSERT.

        Returns the job and whether it was created now. With an Idempotency-Key seen before, the original
        job comes back (same body) or IdempotencyKeyReused is raised (another body), and nothing is started.
        """
        if idempotency_key and (replay := self._replay(idempotency_key, body_sha256)):
            return replay, False
        try:
            return self._create(request, idempotency_key, body_sha256), True
        except (JobActive, sqlalchemy.exc.IntegrityError):
            # A retry racing its original: whichever lost the INSERT answers with the winner's job.
            if idempotency_key and (replay := self._replay(idempotency_key, body_sha256)):
                return replay, False
            raise

    def _replay(self, key: str, body_sha256: str | None) -> Job | None:
        job = repo.find_by_idempotency_key(self.db, key)
        if job is None:
            return None
        if utcnow() - job.created_at > timedelta(days=self.settings.retention_days):
            repo.forget_idempotency_key(self.db, job.id)  # expired with retention: the key is free again
            return None
        if job.request_sha256 != body_sha256:
            raise IdempotencyKeyReused({"Idempotency-Key": [
                f"Already used for job {job.id} with a different request body."]}, job_id=job.id)
        return job

    def _create(self, request: TrainRequest, idempotency_key: str | None, body_sha256: str | None) -> Job:
        request = self.resolve(request)
        manifest = inspect_dataset(Path(request.dataset_dir), request.kohya_folder)
        check_base_model(Path(request.base_model_path))
        if Path(request.lora_file).exists():
            raise OutputExists(f"{request.lora_file} already exists; choose another output_name.",
                               path=request.lora_file)
        self.reconcile_active()
        active = repo.active_job(self.db)
        if active is not None:
            raise JobActive(f"Job {active.id} is already active; one training runs at a time.",
                            active_job_id=active.id)
        require_trainer(self.settings)
        admit(request.tier, request.device_index, self.settings, self.nvml)
        require_free_space(Path(request.output_dir), self.settings.disk_mib[request.tier])
        columns = {**self._columns(request, manifest), "idempotency_key": idempotency_key,
                   "request_sha256": body_sha256}
        job = repo.create_job(self.db, columns)
        try:
            try:
                paths.create_output_dir(Path(request.output_dir))
            except OSError as exc:
                raise LaunchFailed(f"Cannot create {request.output_dir}: {exc.strerror or exc}.") from exc
            self.launch(job.id, self.settings)
        except LaunchFailed as exc:
            repo.transition(self.db, job.id, JobState.FAILED, actor="api", reason=exc.message,
                            failure_class=FailureClass.LAUNCH_ERROR.value, error=exc.message)
            raise
        log.info("job %s accepted: tier %s on device %s", job.id, request.tier, request.device_index)
        return job

    def resolve(self, request: TrainRequest) -> TrainRequest:
        """Resolve and contain every path: `<train root>/<train_id>/` for data and output, a models dir for
        the base model. The resolved strings are what the trainer receives."""
        check_device(request.tier, request.device_index, self.settings)
        root = paths.real_train_root(self.settings.train_root)
        dataset = paths.resolve_dir(request.dataset_dir, root, "dataset_dir")
        output = paths.resolve_new_dir(request.output_dir, root, "output_dir")
        model = paths.resolve_file(request.base_model_path, self.settings.model_dirs, "base_model_path",
                                   suffix=".safetensors")
        train_id = paths.train_id_of(dataset, root)
        paths.require_same_train_dir(dataset, output, root)
        return dataclasses.replace(request, dataset_dir=str(dataset), output_dir=str(output),
                                   base_model_path=str(model), train_id=train_id)

    def _columns(self, request: TrainRequest, manifest: DatasetManifest) -> dict[str, Any]:
        return {
            "train_id": request.train_id, "dataset_dir": request.dataset_dir,
            "base_model_path": request.base_model_path, "output_dir": request.output_dir,
            "output_name": request.output_name, "trigger": request.trigger, "subject_class": request.subject_class,
            "repeats": request.repeats, "tier": request.tier, "device_index": request.device_index,
            "seed": request.seed, "max_grad_norm": request.max_grad_norm,
            "lora_target_modules": request.lora_target_modules, "image_count": manifest.image_count,
            "argv": build_argv(request, self.settings), "env": build_env(request, self.settings),
            "total_steps": TIERS[request.tier].max_train_steps,
            # the reproducibility fingerprint, as far as it is known before the run
            "dataset_sha256": manifest.sha256(),
            "sd_scripts_commit": sd_scripts_commit(self.settings.sd_scripts_dir),
            "trainer_versions": trainer_versions(self.settings.accelerate),
            "estimated_duration_s": estimate_duration(repo.durations_of_similar_jobs(
                self.db, tier=request.tier, device_index=request.device_index, image_count=manifest.image_count)),
        }

    # -- reading -----------------------------------------------------------------------------------------

    def job(self, job_id: int, *, wait_s: float = 0.0, since: int | None = None) -> Job:
        """A job as the ledger has it. With `since`, wait up to `wait_s` for its version to differ from it.

        Waiting takes one of a few long-poll slots, fewer than gunicorn's threads, so waiting clients can
        never leave a cancel without a thread; when the slots are taken, the answer comes at once.
        """
        job = self._job_now(job_id)
        if since is None or wait_s <= 0 or job.version != since:
            return job
        if not self._long_polls.acquire(blocking=False):
            return job
        try:
            deadline = time.monotonic() + wait_s
            while (left := deadline - time.monotonic()) > 0:
                time.sleep(min(LONG_POLL_INTERVAL_S, left))
                job = self._job_now(job_id)
                if job.version != since:
                    break
        finally:
            self._long_polls.release()
        return job

    def progress(self, job_id: int, points: int) -> tuple[Job, list[ProgressPoint]]:
        """The loss curve, thinned to at most `points` evenly spaced steps (the last one always kept)."""
        job = self._job_now(job_id)
        series = repo.progress_points(self.db, job_id)
        if len(series) > points:
            last = len(series) - 1
            picks = sorted({round(i * last / (points - 1)) for i in range(points)}) if points > 1 else [last]
            series = [series[i] for i in picks]
        return job, series

    def _job_now(self, job_id: int) -> Job:
        """A job as the ledger has it, after reconciling it if it claims to be active."""
        if not 0 < job_id <= MAX_JOB_ID:
            raise JobNotFound(f"No job has id {job_id}.", job_id=job_id)
        return current_job(self.db, self.settings, job_id, actor="api")

    def jobs(self, *, status: list[str], limit: int, before_id: int | None) -> list[Job]:
        self.reconcile_active()
        return repo.list_jobs(self.db, status=status, limit=limit, before_id=before_id)

    def log(self, job_id: int, *, lines: int | None, offset: int | None, limit: int) -> LogChunk:
        self._job_now(job_id)
        reader = LogReader(self.settings.log_dir, job_id)
        if offset is not None:
            return reader.read_from(offset, limit)
        return reader.tail_lines(lines if lines is not None else 100)

    def cancel(self, job_id: int) -> Job:
        self._job_now(job_id)
        return repo.request_cancel(self.db, job_id, actor="api")

    def gpu_status(self) -> dict[str, Any]:
        self.reconcile_active()  # a dead supervisor's job is neither active nor "ours"
        return gpu_status(self.nvml.read(), self.settings, repo.active_job(self.db))

    def health(self) -> dict[str, Any]:
        self.reconcile_active()
        active = repo.active_job(self.db)
        try:
            self.nvml.read()
            nvml = "ok"
        except NvmlUnavailable as exc:
            nvml = f"unavailable: {exc.message}"
        return {"status": "ok", "active_job_id": active.id if active else None, "nvml": nvml}

    def reconcile_active(self) -> None:
        reconcile(self.db, self.settings, actor="api")

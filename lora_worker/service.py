"""The worker's operations, one function per thing a client can ask. Views call these and nothing else.

Dispatch checks everything before it writes anything: a refused request leaves no row, no directory and no
process behind.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_worker.config import TIERS, Settings
from lora_worker.errors import JobActive, JobNotFound, LaunchFailed, NvmlUnavailable, OutputExists
from lora_worker.gpu.admission import admit
from lora_worker.gpu.nvml import Nvml
from lora_worker.gpu.status import gpu_status
from lora_worker.invocation import paths
from lora_worker.invocation.builder import build_argv, build_env
from lora_worker.invocation.request import TrainRequest, check_device
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job
from lora_worker.ledger.reconcile import reconcile, reconcile_job
from lora_worker.ledger.states import ACTIVE_STATES, FailureClass, JobState
from lora_worker.preflight.dataset import DatasetManifest, inspect_dataset
from lora_worker.preflight.disk import require_free_space
from lora_worker.preflight.model import check_base_model
from lora_worker.preflight.trainer import require_trainer
from lora_worker.progress.logfile import LogChunk, LogReader

log = logging.getLogger(__name__)

MAX_JOB_ID = 2**63 - 1  # SQLite's INTEGER; anything larger cannot name a job


@dataclass
class Worker:
    """What every operation needs: settings, the ledger, NVML, and how to start a supervisor."""

    settings: Settings
    db: Database
    nvml: Nvml
    launch: Callable[[int, Settings], None]

    # -- dispatch ----------------------------------------------------------------------------------------

    def submit(self, request: TrainRequest) -> Job:
        """Validate, admit, record and launch a job; every refusal happens before the INSERT."""
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
        job = repo.create_job(self.db, self._columns(request, manifest))
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
        }

    # -- reading -----------------------------------------------------------------------------------------

    def job(self, job_id: int) -> Job:
        """A job as the ledger has it, after reconciling it if it claims to be active."""
        if not 0 < job_id <= MAX_JOB_ID:
            raise JobNotFound(f"No job has id {job_id}.", job_id=job_id)
        job = repo.get_job(self.db, job_id)
        if JobState(job.status) in ACTIVE_STATES and reconcile_job(self.db, self.settings, job, actor="api"):
            job = repo.get_job(self.db, job_id)
        return job

    def jobs(self, *, status: list[str], limit: int, before_id: int | None) -> list[Job]:
        self.reconcile_active()
        return repo.list_jobs(self.db, status=status, limit=limit, before_id=before_id)

    def log(self, job_id: int, *, lines: int | None, offset: int | None, limit: int) -> LogChunk:
        self.job(job_id)
        reader = LogReader(self.settings.log_dir, job_id)
        if offset is not None:
            return reader.read_from(offset, limit)
        return reader.tail_lines(lines if lines is not None else 100)

    def cancel(self, job_id: int) -> Job:
        self.job(job_id)
        return repo.request_cancel(self.db, job_id, actor="api")

    def gpu_status(self) -> dict[str, Any]:
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

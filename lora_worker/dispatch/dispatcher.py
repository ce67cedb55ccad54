"""Dispatch: a raw request becomes a resolved one (paths contained, dataset, model, disk, admission), then an
argv and an environment, then one INSERT, then a launch.

Everything is checked before anything is written: a refused request leaves no row, no directory and no
process behind. Only a launch that fails after the INSERT (the output directory or the supervisor could not
be made) leaves a row, `failed` with `launch_error`, so the attempt is on record.

The row records the resolved request once: real paths, train id, argv and env, and the LoRA the run must
produce (file, rank, steps, dtype; name and seed). The supervisor reads all of it back from the row.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy.exc

from lora_worker.config import Settings
from lora_worker.dispatch import paths, presentation
from lora_worker.dispatch.admission import admit
from lora_worker.dispatch.argv import build_argv, build_env
from lora_worker.dispatch.dataset import DatasetManifest, inspect_dataset
from lora_worker.dispatch.disk import require_free_space, required_mib
from lora_worker.dispatch.lint import LintReport, caption_counter, lint_dataset
from lora_worker.dispatch.model import check_base_model
from lora_worker.dispatch.plan import describe
from lora_worker.dispatch.refingerprint import model_identity
from lora_worker.dispatch.samples import disk_counts, prompts_file, write_prompts
from lora_worker.dispatch.request import (ResolvedRequest, TrainRequest, check_device, resolve_request,
                                         webhook_subscription)
from lora_worker.errors import IdempotencyKeyReused, JobActive, LaunchFailed
from lora_worker.host.fingerprint import sd_scripts_commit, trainer_versions
from lora_worker.host.nvml import Nvml
from lora_worker.host.sandbox import require_namespaces, require_sandbox
from lora_worker.host.trainer import require_trainer
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job, utcnow
from lora_worker.backends import Backend
from lora_worker.transcript.eta import estimate_duration
from lora_worker.states import FailureClass

log = logging.getLogger(__name__)


@dataclass
class Dispatcher:
    """What dispatch needs: settings, the ledger, NVML, and the backend that runs the job."""

    settings: Settings
    db: Database
    nvml: Nvml
    backend: Backend

    def submit(self, request: TrainRequest, *, idempotency_key: str | None = None,
               body_sha256: str | None = None) -> tuple[Job, bool]:
        """Validate, admit, record and launch a job; every refusal happens before the INSERT.

        Returns the job and whether it was created now. With an Idempotency-Key seen before, the original
        job comes back (same body) or IdempotencyKeyReused is raised (another body), and nothing is started.
        """
        return self.accept(lambda: self._create(request, idempotency_key, body_sha256), idempotency_key=idempotency_key,
                           body_sha256=body_sha256)

    def accept(self, create: Callable[[], Job], *, idempotency_key: str | None,
               body_sha256: str | None) -> tuple[Job, bool]:
        """`create()` unless the Idempotency-Key names a job already (POST /train's and a resume's one rule)."""
        if idempotency_key and (replay := self._replay(idempotency_key, body_sha256)):
            return replay, False
        try:
            return create(), True
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

    def _create(self, raw: TrainRequest, idempotency_key: str | None, body_sha256: str | None) -> Job:
        request, manifest, report, config = self._checked(raw)
        columns = {**self._columns(request, manifest, config), "idempotency_key": idempotency_key,
                   "request_sha256": body_sha256, "backend": self.backend.name,
                   "webhook_events": webhook_subscription(self.settings, raw),
                   "dataset_warnings": json.dumps([w.as_dict() for w in report.warnings], ensure_ascii=False)}
        write_prompts(prompts_file(request.samples, request.tier, self.settings, self.backend))
        return self.launch(columns, request.output_dir, config=config)

    def plan(self, raw: TrainRequest) -> dict[str, Any]:
        """POST /train?dry_run=1: every check `submit` makes, the same refusals, and nothing started or written (no
        row, no directory, no lock beyond admission's probe, no event): what the job would be."""
        started = time.monotonic()
        request, manifest, report, config = self._checked(raw)
        history = repo.durations_of_similar_jobs(
            self.db, backend=self.backend.name, tier=request.tier.name, image_count=manifest.image_count,
            device_index=request.device_index if self.backend.places_here else None)
        return describe(request, self.settings, self.backend, report, config, history=history,
                        seconds=time.monotonic() - started)

    def _checked(self, raw: TrainRequest) -> tuple[ResolvedRequest, DatasetManifest, LintReport,
                                                   presentation.DatasetConfig]:
        """The request resolved, its dataset read and linted (a 422 on any error), its model and output checked, its
        dataset config made (not yet written), and the host and slots admitting it now: every refusal of a new job,
        in order, changing nothing."""
        request = self.resolve(raw)
        manifest = inspect_dataset(request.dataset_dir, request.kohya_folder)
        report = lint_dataset(request.dataset_dir, manifest, resolution=request.tier.resolution,
                              counter=caption_counter(self.settings))
        report.raise_errors()
        check_base_model(request.base_model_path)
        paths.require_no_output(str(request.lora_file))
        config = presentation.config_for(request, self.settings, self.backend, manifest.image_count, report.buckets())
        self.admit(request.tier.name, request.device_index, request.output_dir, request.tier.network_dim,
                   disk_counts(request.samples, request.expected.steps,
                               self.settings.save_every_n_steps(request.tier.name)))
        return request, manifest, report, config

    def admit(self, tier: str, device_index: int, output_dir: Path, network_dim: int,
              kept: dict[str, int] | None = None, *, resuming: bool = False) -> None:
        """What a new row needs of the host and the slots now (a fresh job's and a resume's)."""
        if len(self.backend.slots(self.settings)) == 1:
            active = repo.active_job(self.db)
            if active is not None:
                # No Retry-After: the ETA is an estimate, and a client told to wait that long would be told a
                # guess as if it were known (docs/errors.md, "Status codes and errors").
                raise JobActive(f"Job {active.id} is already active; one training runs at a time.",
                                active_job_id=active.id)
        require_trainer(self.settings)
        if self.backend.places_here:  # else the scheduler allocates the GPU and its cgroup holds the job
            require_sandbox(self.settings)
            require_namespaces(self.settings)  # probed once (at start-up): bwrap can make them here
            admit(tier, device_index, self.settings, self.nvml)
        require_free_space(output_dir, required_mib(self.settings.disk_mib[tier], network_dim, **(kept or {}),
                                                    resuming=resuming))

    def launch(self, columns: dict[str, Any], output_dir: Path, *, output_id: str | None = None,
               config: presentation.DatasetConfig | None = None) -> Job:
        """INSERT the row and launch it on the backend: the one way a job starts. `output_id`: the identity of an
        output directory that exists already (a resume's); else the directory is created here. `config`: the
        dataset config its argv names, put in place here (None: a row that names none)."""
        job = self._insert(columns)
        try:
            if output_id is None:
                try:
                    output_id = str(paths.create_output_dir(output_dir))
                except OSError as exc:
                    raise LaunchFailed(f"Cannot create {output_dir}: {exc.strerror or exc}.") from exc
            repo.record_output_identity(self.db, job.id, output_id)
            if config is not None:
                presentation.write(config)
            self.backend.launch(job.id, self.settings)
        except LaunchFailed as exc:
            # No supervisor ran, so there is no run log to quote: the sentence is the whole story. Nothing ran
            # either, so the key is freed in the same write: a retry with it launches again (a 503 is retryable),
            # instead of replaying this failed row.
            repo.fail_job(self.db, job.id, actor="api", failure_class=FailureClass.LAUNCH_ERROR, sentence=exc.message,
                          idempotency_key=None)
            raise
        log.info("job %s accepted: tier %s on device %s", job.id, columns["tier"], columns["device_index"])
        return job

    def _insert(self, columns: dict[str, Any]) -> Job:
        """The row, in the first free slot of the backend's (local: "train"; Slurm: one per max_active_jobs).
        Whether a slot is free is the one-active-job index's to say (an INSERT into a taken slot is refused,
        and the next is tried), never a count here: two racing requests cannot both take the last slot."""
        slots = self.backend.slots(self.settings)
        for slot in slots:
            try:
                return repo.create_job(self.db, {**columns, "slot": slot})
            except JobActive as exc:
                if len(slots) == 1 or "lora_file" in exc.details:
                    raise  # the one slot, or another active job writes this LoRA file: no other slot changes that
        oldest = repo.active_job(self.db)
        raise JobActive(f"{len(slots)} jobs are already active on {self.backend.label} (max_active_jobs).",
                        active_job_id=oldest.id if oldest else None)

    def resolve(self, request: TrainRequest) -> ResolvedRequest:
        """Resolve and contain every path: `<train root>/<train_id>/` for data and output, a models dir for
        the base model. The resolved paths are what the trainer receives."""
        if self.backend.places_here:  # else device_index is accepted and has no effect: the scheduler picks the GPU
            check_device(request.tier, request.device_index, self.settings)
        root = paths.real_train_root(self.settings.train_root)
        dataset = paths.resolve_dir(request.dataset_dir, root, "dataset_dir")
        output = paths.resolve_new_dir(request.output_dir, root, "output_dir")
        model = paths.resolve_file(request.base_model_path, self.settings.model_dirs, "base_model_path",
                                   suffix=".safetensors")
        paths.require_same_train_dir(dataset, output, root)
        return resolve_request(request, train_id=paths.train_id_of(dataset, root), dataset_dir=dataset,
                               base_model_path=model, output_dir=output, tiers=self.settings.tiers)

    def _columns(self, request: ResolvedRequest, manifest: DatasetManifest,
                 config: presentation.DatasetConfig) -> dict[str, Any]:
        return {
            **request.row_columns(), "image_count": manifest.image_count,
            "argv": build_argv(request, self.settings, self.backend, config),
            "env": build_env(request, self.settings, self.backend),
            # the reproducibility fingerprint, as far as it is known before the run
            "dataset_sha256": manifest.sha256(),
            "base_model_identity": model_identity(str(request.base_model_path)),  # what a resume compares
            **manifest.identities(),  # compared again right before exec
            "sd_scripts_commit": sd_scripts_commit(self.settings.sd_scripts_dir),
            "trainer_versions": trainer_versions(self.settings.accelerate),
            "estimated_duration_s": estimate_duration(repo.durations_of_similar_jobs(
                self.db, backend=self.backend.name, tier=request.tier.name, image_count=manifest.image_count,
                device_index=request.device_index if self.backend.places_here else None)),
        }

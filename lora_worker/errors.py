"""The worker's domain errors. Each class's docstring is its default message; `code` is the machine reason.

    LoraWorkerError
     ├── ConfigError                  settings unreadable or wrong (the service refuses to start)
     ├── LedgerCorrupt                the SQLite file fails its integrity check (refuses to start)
     ├── InvalidRequest               422: a parameter is out of bounds (field errors attached)
     │    ├── DatasetInvalid          422: the dataset folder is not what the request describes
     │    ├── BaseModelInvalid        422: the base model is not a readable SDXL checkpoint
     │    ├── IdempotencyKeyReused    422: the same Idempotency-Key came with another body
     │    └── OutputExists            422: the LoRA file to be written already exists (field output_name)
     ├── JobNotFound                  404
     │    ├── EventNotFound           404: the job has no webhook event with this id
     │    └── SampleNotFound          404: the job has no sample image of this name (or none at all)
     ├── JobGone                      410: the ledger lost the job; its run log is all that is left
     ├── SampleGone                   410: the listed sample image is no longer the file that was decoded
     ├── Conflict                     409: busy now; the same request may succeed later
     │    ├── JobActive               409: another job is queued or running
     │    ├── InsufficientVram        409: the device has too little free memory for the tier
     │    ├── GpuBusy                 409: a foreign compute process is on the device
     │    └── GpuLocked               409: another trainer holds the host-wide device lock
     ├── JobFinished                  409: the job already ended (cancel of a finished job); never retry
     ├── NotResumable                 422: POST /train/<id>/resume: no state passes (`reasons`, RESUME_REASONS)
     ├── NotPromotable                422: POST /train/<id>/promote: the step's LoRA cannot be the result (`reason`)
     ├── InsufficientStorage          507
     │    └── InsufficientDisk        507: the output volume is too full for the tier
     └── Unavailable                  503
          ├── TrainerUnavailable      503: the sd-scripts installation is incomplete
          ├── SandboxUnavailable      503: sandbox = "bwrap" but bubblewrap is not installed
          ├── NvmlUnavailable         503: no NVIDIA driver / NVML, or a device's processes unreadable
          ├── TrainRootMissing        503: the train root does not exist on this host (not mounted)
          ├── LedgerBusy              503: the ledger stayed locked past the busy timeout
          ├── LedgerUnwritable        503: the ledger's disk is full or failing
          ├── HostNotReady            503: /healthz?deep=1: the deep checks did not find the host can train
          ├── LedgerReplaced          503: the ledger file was deleted or replaced under the service
          ├── LogUnreadable           503: a file of the run log is a link, a FIFO… (planted in the state dir)
          └── LaunchFailed            503: the supervisor process could not be started

HTTP statuses are assigned in `lora_worker.web.errors`; nothing here knows about HTTP. What a client may do is
known here, though: `retryable` says whether the same request, unchanged, can succeed later by waiting alone
(a busy GPU frees up; an existing output file never goes away), and `retry_after_s`, when a wait is known,
how long to wait.
"""
from __future__ import annotations

from typing import Any

from lora_worker.refusals import PROMOTE_REASONS as PROMOTE_REASONS, RESUME_REASONS as RESUME_REASONS


class LoraWorkerError(Exception):
    """The worker failed."""

    code = "internal_error"
    retryable = False
    retry_after_s: float | None = None  # a class default; a raise site that knows the wait passes its own

    def __init__(self, message: str | None = None, *, retry_after_s: float | None = None, **details: Any) -> None:
        self.message = message or (self.__doc__ or self.code).strip()
        self.details = details
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s
        super().__init__(self.message)


class ConfigError(LoraWorkerError):
    """The worker's settings are invalid."""

    code = "config_invalid"


class LedgerCorrupt(LoraWorkerError):
    """The job ledger failed its integrity check; it was left untouched."""

    code = "ledger_corrupt"


class InvalidRequest(LoraWorkerError):
    """The request has invalid parameters."""

    code = "validation_failed"

    def __init__(self, fields: dict[str, list[str]], message: str | None = None, **details: Any) -> None:
        super().__init__(message or _summary(fields), fields=fields, **details)
        self.fields = fields


class DatasetInvalid(InvalidRequest):
    """The dataset does not match the request."""

    code = "dataset_invalid"


class BaseModelInvalid(InvalidRequest):
    """The base model is not a readable SDXL checkpoint."""

    code = "base_model_invalid"


class IdempotencyKeyReused(InvalidRequest):
    """This Idempotency-Key was already used with a different request body."""

    code = "idempotency_key_reused"


class OutputExists(InvalidRequest):
    """The LoRA file this job would write already exists; a finished LoRA is never overwritten."""

    code = "output_exists"

    # Invalid, not busy: the file stays, so the same request would fail forever. It names the field to change.
    def __init__(self, message: str | None = None, **details: Any) -> None:
        text = message or (self.__doc__ or self.code).strip()
        super().__init__({"output_name": [text]}, text, **details)


class JobNotFound(LoraWorkerError):
    """No job has this id."""

    code = "job_not_found"


class JobGone(LoraWorkerError):
    """The ledger no longer holds this job; only its run log is left."""

    code = "job_gone"


class EventNotFound(JobNotFound):
    """The job has no webhook event with this id."""

    code = "event_not_found"


class SampleNotFound(JobNotFound):
    """The job has no sample image of this name."""

    code = "sample_not_found"


class SampleGone(LoraWorkerError):
    """The sample image is no longer the file that was listed (removed, replaced or changed on disk)."""

    code = "sample_gone"


class Conflict(LoraWorkerError):
    """The device or the one job slot is busy now; the same request may be accepted later."""

    code = "conflict"
    retryable = True


class JobActive(Conflict):
    """Another training job is already active."""

    code = "job_active"


class JobFinished(LoraWorkerError):
    """The job has already finished."""

    code = "job_finished"


class InsufficientVram(Conflict):
    """The device has too little free memory for this tier."""

    code = "insufficient_vram"


class GpuBusy(Conflict):
    """Another program is computing on this device."""

    code = "gpu_busy"


class GpuLocked(Conflict):
    """Another trainer holds this device's host-wide lock."""

    code = "gpu_locked"


class InsufficientStorage(LoraWorkerError):
    """There is not enough storage to do this."""

    code = "insufficient_storage"


class InsufficientDisk(InsufficientStorage):
    """The output volume has too little free space for this tier."""

    code = "insufficient_disk"


class Unavailable(LoraWorkerError):
    """The worker cannot serve this request right now."""

    code = "unavailable"


class TrainerUnavailable(Unavailable):
    """The trainer installation is incomplete."""

    code = "trainer_unavailable"


class SandboxUnavailable(Unavailable):
    """The trainer's sandbox (bubblewrap) is configured but not installed."""

    code = "sandbox_unavailable"


class NvmlUnavailable(Unavailable):
    """NVML (the NVIDIA driver's management library) is not available on this host."""

    code = "nvml_unavailable"


class TrainRootMissing(Unavailable):
    """The train root does not exist on this host (not mounted, or removed)."""

    code = "train_root_missing"


class LedgerBusy(Unavailable):
    """The job ledger is locked by another process; retry shortly."""

    code = "ledger_busy"
    retryable = True
    retry_after_s = 1.0


class HostNotReady(Unavailable):
    """The deep health checks have not found that this host can train (still running, or one failed)."""

    code = "host_not_ready"


class LedgerReplaced(Unavailable):
    """The file at the ledger path is no longer the ledger the service opened (deleted or replaced)."""

    code = "ledger_replaced"


class LedgerUnwritable(Unavailable):
    """The job ledger cannot be written right now (disk full or failing); retry later."""

    code = "ledger_unwritable"
    retryable = True
    retry_after_s = 10.0


class LogUnreadable(Unavailable):
    """The job's run log cannot be read: something that is not its regular file is where it was."""

    code = "log_unreadable"


class LaunchFailed(Unavailable):
    """The job supervisor could not be started."""

    code = "launch_failed"
    retryable = True  # a fork or exec that failed under load; nothing about the request was wrong


class NotResumable(LoraWorkerError):
    """The job cannot be resumed: no saved state passes every check (details.reasons says why)."""

    code = "not_resumable"


class NotPromotable(LoraWorkerError):
    """The step's LoRA cannot be made the job's result (details.reason says why: PROMOTE_REASONS)."""

    code = "not_promotable"


def _summary(fields: dict[str, list[str]]) -> str:
    parts = [f"{name}: {'; '.join(msgs)}" for name, msgs in sorted(fields.items())]
    return "Invalid request: " + " | ".join(parts)

"""The worker's domain errors. Each class's docstring is its default message; `code` is the machine reason.

    LoraWorkerError
     ├── ConfigError                  settings unreadable or wrong (the service refuses to start)
     ├── LedgerCorrupt                the SQLite file fails its integrity check (refuses to start)
     ├── InvalidRequest               422: a parameter is out of bounds (field errors attached)
     │    ├── DatasetInvalid          422: the dataset folder is not what the request describes
     │    ├── BaseModelInvalid        422: the base model is not a readable SDXL checkpoint
     │    └── IdempotencyKeyReused    422: the same Idempotency-Key came with another body
     ├── JobNotFound                  404
     ├── Conflict                     409
     │    ├── JobActive               409: another job is queued or running
     │    ├── JobFinished             409: the job already ended (cancel of a finished job)
     │    ├── InsufficientVram        409: the device has too little free memory for the tier
     │    ├── GpuBusy                 409: a foreign compute process is on the device
     │    ├── GpuLocked               409: another trainer holds the host-wide device lock
     │    ├── InsufficientDisk        409: the output volume is too full for the tier
     │    └── OutputExists            409: the LoRA file to be written already exists
     └── Unavailable                  503
          ├── TrainerUnavailable      503: the sd-scripts installation is incomplete
          ├── SandboxUnavailable      503: sandbox = "bwrap" but bubblewrap is not installed
          ├── NvmlUnavailable         503: no NVIDIA driver / NVML on this host
          ├── LedgerBusy              503: the ledger stayed locked past the busy timeout
          ├── LedgerUnwritable        503: the ledger's disk is full or failing
          ├── LedgerReplaced          503: the ledger file was deleted or replaced under the service
          └── LaunchFailed            503: the supervisor process could not be started

HTTP statuses are assigned in `lora_worker.web.errors`; nothing here knows about HTTP.
"""
from __future__ import annotations

from typing import Any


class LoraWorkerError(Exception):
    """The worker failed."""

    code = "internal_error"

    def __init__(self, message: str | None = None, **details: Any) -> None:
        self.message = message or (self.__doc__ or self.code).strip()
        self.details = details
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


class JobNotFound(LoraWorkerError):
    """No job has this id."""

    code = "job_not_found"


class Conflict(LoraWorkerError):
    """The request conflicts with the worker's current state."""

    code = "conflict"


class JobActive(Conflict):
    """Another training job is already active."""

    code = "job_active"


class JobFinished(Conflict):
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


class InsufficientDisk(Conflict):
    """The output volume has too little free space for this tier."""

    code = "insufficient_disk"


class OutputExists(Conflict):
    """The LoRA file this job would write already exists; a finished LoRA is never overwritten."""

    code = "output_exists"


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


class LedgerBusy(Unavailable):
    """The job ledger is locked by another process; retry shortly."""

    code = "ledger_busy"


class LedgerReplaced(Unavailable):
    """The file at the ledger path is no longer the ledger the service opened (deleted or replaced)."""

    code = "ledger_replaced"


class LedgerUnwritable(Unavailable):
    """The job ledger cannot be written right now (disk full or failing); retry later."""

    code = "ledger_unwritable"


class LaunchFailed(Unavailable):
    """The job supervisor could not be started."""

    code = "launch_failed"


def _summary(fields: dict[str, list[str]]) -> str:
    parts = [f"{name}: {'; '.join(msgs)}" for name, msgs in sorted(fields.items())]
    return "Invalid request: " + " | ".join(parts)

"""Where the job and GPU lock files live. Both are flock()ed for a holder's whole life."""
from __future__ import annotations

from pathlib import Path

from lora_worker.config import Settings


def job_lock_path(settings: Settings, job_id: int) -> Path:
    """Held by the job's supervisor: free means nobody is supervising the job."""
    return settings.lock_dir / f"job-{job_id}.lock"


def gpu_lock_path(settings: Settings, device_index: int) -> Path:
    """The host-wide per-GPU interlock: whoever holds it trains on that card (README, "GPU interlock")."""
    return settings.gpu_locks / f"gpu-{device_index}.lock"

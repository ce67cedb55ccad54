"""The job and GPU lock files: where they live, and taking and probing them. Each is flock()ed for its
holder's whole life; the kernel drops the lock when the holder dies, zombie or not."""
from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from lora_worker.config import Settings


def job_lock_path(settings: Settings, job_id: int) -> Path:
    """Held by the job's supervisor: free means nobody is supervising the job."""
    return settings.lock_dir / f"job-{job_id}.lock"


def gpu_lock_path(settings: Settings, device_index: int) -> Path:
    """The host-wide per-GPU interlock: whoever holds it trains on that card (README, "GPU interlock")."""
    return settings.gpu_locks / f"gpu-{device_index}.lock"


def hold_lock(path: Path) -> int | None:
    """Take an exclusive flock on `path` without waiting; the fd (to keep open) or None if held elsewhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def take_lock(path: Path, wait_s: float) -> int | None:
    """`hold_lock`, retried for up to `wait_s`: a reconcile or an admission check probing the lock holds it
    shared for microseconds, which must not pass for another holder."""
    deadline = time.monotonic() + wait_s
    while (fd := hold_lock(path)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return fd


def is_locked(path: Path) -> bool:
    """Whether some process holds an exclusive flock on `path`. The kernel drops a lock when its holder dies,
    so this answers "is the holder alive?" without looking at any pid. A shared probe never blocks a holder
    that is about to take the lock for long, and is released at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # closing drops our shared lock, if we got it

"""The job and GPU lock files: where they live, and taking and probing them. Each is flock()ed for its
holder's whole life; the kernel drops the lock when the holder dies, zombie or not.

The GPU lock files are the host-wide interlock every trainer joins, whoever it runs as, so:
- locks are taken on a read-only descriptor (flock needs no write access): a lock file another trainer
  created with its own umask (flock(1) makes 0644 files) is still ours to lock;
- a file we create is as open as its directory (`lock_file_mode`): in the group's 3770 directory it is 0660,
  in an everyone's 1777 directory 0666, in the private job-lock directory 0640;
- the directory may be writable by others, so a name there is never trusted: no link is followed, nothing that
  may block (a FIFO) is opened, and only a regular file counts as a lock.
"""
from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from lora_worker.config import Settings
# Taking a lock is in host/flock.py, which imports nothing heavy: a supervisor takes its job lock first thing.
from lora_worker.host.flock import (NotALockFile, hold_lock, lock_file_mode,  # noqa: F401 - theirs, re-exported
                                    open_lock_file, take_lock as take_lock)

# The GPU lock directory: setgid keeps new lock files in the group, sticky stops anyone deleting another's lock
# file (a deleted file would let a second trainer "lock" a new inode while the first still trains).
GPU_LOCK_DIR_MODE_GROUP = 0o3770
GPU_LOCK_DIR_MODE_EVERYONE = 0o1777
PROC_LOCKS = Path("/proc/locks")


def job_lock_path(settings: Settings, job_id: int) -> Path:
    """Held by the job's supervisor: free means nobody is supervising the job."""
    return settings.lock_dir / f"job-{job_id}.lock"


def gpu_lock_path(settings: Settings, device_index: int) -> Path:
    """The host-wide per-GPU interlock: whoever holds it trains on that card (docs/gpus.md, "GPU interlock")."""
    return settings.gpu_locks / f"gpu-{device_index}.lock"


def gpu_lock_dir_mode(settings: Settings) -> int:
    """The mode the GPU lock directory must have so that every trainer the settings admit can join."""
    return GPU_LOCK_DIR_MODE_EVERYONE if settings.gpu_lock_everyone else GPU_LOCK_DIR_MODE_GROUP


def is_locked(path: Path) -> bool:
    """Whether some process holds an exclusive flock on `path`. The kernel drops a lock when its holder dies,
    so this answers "is the holder alive?" without looking at any pid. A shared probe never blocks a holder
    that is about to take the lock for long, and is released at once.

    Something planted under the lock's name (a link, a FIFO) counts as held: no trainer can lock it, so the
    device is not free until an operator removes it."""
    try:
        fd = open_lock_file(path, create=False)
    except NotALockFile:
        return True
    if fd is None:
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


@dataclass(frozen=True)
class LockState:
    held: bool
    holder_pid: int | None  # from /proc/locks; None when free, or when the holder is outside our pid namespace


def lock_state(path: Path) -> LockState:
    """Whether the lock is held and by which process: /proc/locks names the pid that took each flock, by
    device and inode. The pid is what the kernel recorded when the lock was taken; a holder that handed its fd
    to a child and exited still shows its own pid (docs/gpus.md says so)."""
    if not is_locked(path):
        return LockState(False, None)
    try:
        st = os.lstat(path)
    except OSError:
        return LockState(True, None)
    return LockState(True, flock_holder(st.st_dev, st.st_ino))


def flock_holder(device: int, inode: int, proc_locks: Path = PROC_LOCKS) -> int | None:
    """The pid of the exclusive flock() holder of (device, inode) in /proc/locks, if any.

    A line reads `1: FLOCK  ADVISORY  WRITE 4242 08:01:1311 0 EOF` (major:minor in hex, inode in decimal);
    `->` lines are waiters, not holders, and a shared probe is READ."""
    wanted = f"{os.major(device):02x}:{os.minor(device):02x}:{inode}"
    try:
        text = proc_locks.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->":
            continue
        kind, access, pid, where = parts[1], parts[3], parts[4], parts[5]
        if kind == "FLOCK" and access == "WRITE" and where == wanted and pid.lstrip("-").isdigit():
            return int(pid) if int(pid) > 0 else None
    return None

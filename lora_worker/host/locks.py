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
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from lora_worker.config import Settings

# The GPU lock directory: setgid keeps new lock files in the group, sticky stops anyone deleting another's lock
# file (a deleted file would let a second trainer "lock" a new inode while the first still trains).
GPU_LOCK_DIR_MODE_GROUP = 0o3770
GPU_LOCK_DIR_MODE_EVERYONE = 0o1777
PROC_LOCKS = Path("/proc/locks")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def job_lock_path(settings: Settings, job_id: int) -> Path:
    """Held by the job's supervisor: free means nobody is supervising the job."""
    return settings.lock_dir / f"job-{job_id}.lock"


def gpu_lock_path(settings: Settings, device_index: int) -> Path:
    """The host-wide per-GPU interlock: whoever holds it trains on that card (README, "GPU interlock")."""
    return settings.gpu_locks / f"gpu-{device_index}.lock"


def gpu_lock_dir_mode(settings: Settings) -> int:
    """The mode the GPU lock directory must have so that every trainer the settings admit can join."""
    return GPU_LOCK_DIR_MODE_EVERYONE if settings.gpu_lock_everyone else GPU_LOCK_DIR_MODE_GROUP


def lock_file_mode(dir_mode: int) -> int:
    """A new lock file is readable by whoever may enter its directory, and writable by whoever may write it."""
    mode = 0o600
    for enter, write, read_bit, write_bit in ((0o010, 0o020, 0o040, 0o020), (0o001, 0o002, 0o004, 0o002)):
        if dir_mode & enter:
            mode |= read_bit | (write_bit if dir_mode & write else 0)
    return mode


class NotALockFile(OSError):
    """The lock's name is a link, a FIFO, a directory…: something planted there, never a lock to take."""


def open_lock_file(path: Path, *, create: bool) -> int | None:
    """A read-only fd on the regular file at `path`; None if it is absent and `create` is false.

    Open first without O_CREAT: with fs.protected_regular, O_CREAT on another user's file in a sticky
    directory fails with EACCES even though the file exists. Create with O_EXCL, so a name that appears
    between the two opens is opened again rather than trusted."""
    while True:
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            if not create:
                return None
            try:
                fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            # fchmod, not the open's mode: the umask (0007 under the unit) must not narrow who may join.
            os.fchmod(fd, lock_file_mode(os.stat(path.parent).st_mode))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotALockFile(errno.ELOOP, "a symbolic link, not a lock file", str(path)) from exc
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotALockFile(errno.EINVAL, "not a regular file", str(path))
        return fd


def hold_lock(path: Path) -> int | None:
    """Take an exclusive flock on `path` without waiting; the fd (to keep open) or None if held elsewhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_lock_file(path, create=True)
    assert fd is not None
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
    to a child and exited still shows its own pid (the README says so)."""
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

"""Taking a lock file: the no-follow, no-block open and the flock, for host/locks.py and for a supervisor's very
first step. A job's supervisor takes its job lock before it imports anything else of the worker (run/__main__.py),
since the web's POST /train waits for that lock: so only `os` and the C-level modules are imported here, and
paths are plain strings or PathLikes.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def lock_file_mode(dir_mode: int) -> int:
    """A new lock file is readable by whoever may enter its directory, and writable by whoever may write it."""
    mode = 0o600
    for enter, write, read_bit, write_bit in ((0o010, 0o020, 0o040, 0o020), (0o001, 0o002, 0o004, 0o002)):
        if dir_mode & enter:
            mode |= read_bit | (write_bit if dir_mode & write else 0)
    return mode


class NotALockFile(OSError):
    """The lock's name is a link, a FIFO, a directory…: something planted there, never a lock to take."""


def open_lock_file(path: str | os.PathLike[str], *, create: bool) -> int | None:
    """A read-only fd on the regular file at `path`; None if it is absent and `create` is false.

    Open first without O_CREAT: with fs.protected_regular, O_CREAT on another user's file in a sticky
    directory fails with EACCES even though the file exists. Create with O_EXCL, so a name that appears
    between the two opens is opened again rather than trusted."""
    try:
        dir_fd = _open_lock_dir(path)
    except FileNotFoundError:
        if not create:
            return None
        raise
    name = os.path.basename(os.fspath(path))
    try:
        while True:
            try:
                fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                if not create:
                    return None
                try:
                    fd = os.open(name, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
                except FileExistsError:
                    continue
                # fchmod, not the open's mode: the umask (0007 under the unit) must not narrow who may join.
                os.fchmod(fd, lock_file_mode(os.fstat(dir_fd).st_mode))
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise NotALockFile(errno.ELOOP, "a symbolic link, not a lock file", str(path)) from exc
                raise
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise NotALockFile(errno.EINVAL, "not a regular file", str(path))
            return fd
    finally:
        os.close(dir_fd)


def _open_lock_dir(path: str | os.PathLike[str]) -> int:
    """The lock's directory (locks/, the GPU lock dir), never through a link at its own name: one planted
    there would put every lock somewhere else."""
    directory = (os.path.dirname(os.fspath(path)) or ".").rstrip("/") or "/"
    parent = os.open(os.path.dirname(directory) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open(os.path.basename(directory) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotALockFile(exc.errno, "its directory is a symbolic link or not a directory", directory) from exc
        raise
    finally:
        os.close(parent)


def hold_lock(path: str | os.PathLike[str]) -> int | None:
    """Take an exclusive flock on `path` without waiting; the fd (to keep open) or None if held elsewhere."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
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


def take_lock(path: str | os.PathLike[str], wait_s: float) -> int | None:
    """`hold_lock`, retried for up to `wait_s`: a reconcile or an admission check probing the lock holds it
    shared for microseconds, which must not pass for another holder."""
    deadline = time.monotonic() + wait_s
    while (fd := hold_lock(path)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return fd

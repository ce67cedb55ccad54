"""Looking at the shared train root without trusting it: no link followed, no open that can block, no path
used twice.

arbo and its users write the train root; the worker reads it. So every walk here goes one component at a
time from `/` with `O_NOFOLLOW`, each step relative to the directory opened before it (a swap of any
component between two steps is seen, not followed), every open of a file adds `O_NONBLOCK` (a FIFO opens at
once instead of waiting for a writer) and checks with `fstat` what it got before reading a byte. A file or
directory is named by its (device, inode): a path can be made to point elsewhere, an identity cannot.
"""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
NAME_MAX = os.pathconf("/", "PC_NAME_MAX") if hasattr(os, "pathconf") else 255


class Refused(OSError):
    """The entry is not what may be opened: a link, a FIFO, a device, a socket, or not the expected one."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@dataclass(frozen=True)
class FileId:
    """(st_dev, st_ino): which file this is, whatever path leads to it now."""

    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino)

    @classmethod
    def parse(cls, text: str) -> FileId:
        dev, ino = text.split(":")
        return cls(int(dev), int(ino))

    def __str__(self) -> str:  # what the ledger stores
        return f"{self.dev}:{self.ino}"


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def check_length(path: str) -> str | None:
    """Why the OS would refuse this absolute path as too long (ENAMETOOLONG), or None."""
    if len(os.fsencode(path)) >= PATH_MAX:
        return f"is longer than the system's limit of {PATH_MAX - 1} bytes"
    for part in path.split("/"):
        if len(os.fsencode(part)) > NAME_MAX:
            return f"has a component longer than the system's limit of {NAME_MAX} bytes ({part[:32]}…)"
    return None


def open_dir(path: str) -> int:
    """Open an absolute directory path with no symlink in any component; the caller closes the fd.

    Refused names the first component that is a link or not a directory; other OSErrors (ENOENT, EACCES,
    ENAMETOOLONG) pass through."""
    if not os.path.isabs(path):
        raise ValueError(f"not an absolute path: {path!r}")
    fd = os.open("/", DIR_FLAGS)
    walked = ""
    try:
        for name in (p for p in path.split("/") if p):
            if name in (".", ".."):
                raise Refused(errno.EINVAL, f"{walked}/{name}: '.' and '..' are not walked")
            walked += "/" + name
            child = open_subdir(fd, name, shown=walked)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def identity_of_dir(path: str) -> FileId:
    """The identity of the directory at `path`, reached without following any link."""
    fd = open_dir(path)
    try:
        return FileId.of(os.fstat(fd))
    finally:
        os.close(fd)


def entry_at(dir_fd: int, name: str) -> os.stat_result | None:
    """What is at `name` in the directory, never following a link; None if nothing is."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_subdir(dir_fd: int, name: str, *, shown: str | None = None) -> int:
    """A real directory (not a link to one) inside `dir_fd`; `shown` is how an error names it."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        raise Refused(errno.ELOOP, f"{shown or name} is a {kind_of(st.st_mode)}, not a directory") from exc


def open_regular(dir_fd: int | None, name: str) -> tuple[int, os.stat_result]:
    """A regular file inside `dir_fd` (or at the path `name`, with None), opened read-only without following a
    link and without blocking."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise Refused(errno.ELOOP, f"{name} is a symlink, not a regular file") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Refused(errno.EINVAL, f"{name} is a {kind_of(st.st_mode)}, not a regular file")
    return fd, st


def open_in(directory: str | os.PathLike[str], name: str, flags: int = os.O_RDONLY, mode: int = 0o640) -> int:
    """`name` in one of our own directories (the state dir's logs/, …): the path up to `directory` is the
    operator's, but `directory` itself is not followed if it is a link, nor is `name`, and nothing blocks (a
    FIFO read answers at once, a FIFO write ENXIO). Refused unless what opened is a regular file; other OSErrors
    (ENOENT, EEXIST with O_EXCL, ENOSPC) pass through. `flags` may add O_CREAT, O_EXCL, O_APPEND, O_TRUNC."""
    path = os.fspath(directory)
    parent = os.open(os.path.dirname(path.rstrip("/")) or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dir_fd = open_subdir(parent, os.path.basename(path.rstrip("/")), shown=path)
    finally:
        os.close(parent)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise Refused(errno.ELOOP, f"{path}/{name} is a symlink, not a regular file") from exc
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Refused(errno.EINVAL, f"{path}/{name} is a {kind_of(st.st_mode)}, not a regular file")
    return fd


def read_capped(fd: int, cap: int) -> bytes:
    """At most `cap` bytes of a regular file; Refused if it holds more (nothing past cap+1 is read)."""
    chunks: list[bytes] = []
    got = 0
    while got <= cap:
        block = os.read(fd, cap + 1 - got)
        if not block:
            break
        chunks.append(block)
        got += len(block)
    if got > cap:
        raise Refused(errno.EFBIG, f"larger than {cap} bytes")
    return b"".join(chunks)


def real_path_of(fd: int) -> str:
    """The path the kernel has for an open file now (after a rename, its new place)."""
    return os.readlink(f"/proc/self/fd/{fd}")


def list_entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """Every entry of the directory with its lstat, in name order."""
    with os.scandir(dir_fd) as it:
        names = sorted(entry.name for entry in it)
    out = []
    for name in names:
        st = entry_at(dir_fd, name)
        if st is not None:  # removed meanwhile: nothing to open
            out.append((name, st))
    return out


def make_dirs(path: str, mode: int = 0o770) -> FileId:
    """Create the missing directories of `path` (no link followed on the way), each `mode` plus the setgid
    bit of its parent, and return the identity of the last one. An existing one is kept as it is."""
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", DIR_FLAGS)
    walked = ""
    try:
        for name in parts:
            walked += "/" + name
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            parent_mode = os.fstat(fd).st_mode
            child = open_subdir(fd, name, shown=walked)
            os.close(fd)
            fd = child
            if created:
                # mkdir applies the umask; the shared group must be able to read and clean up outputs.
                os.fchmod(fd, mode | (parent_mode & stat.S_ISGID))
        return FileId.of(os.fstat(fd))
    finally:
        os.close(fd)


NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_new(path: str, data: bytes, mode: int = 0o640) -> FileId:
    """A file made now at `path`, holding `data`: never an existing file, never through a link (the name taken,
    by anything, is FileExistsError; a link there is never followed)."""
    fd = os.open(path, NEW_FILE_FLAGS, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return FileId.of(os.fstat(fd))
    finally:
        os.close(fd)

"""Reading a saved state's torch zip archives through their CRCs (host/train_state.py's costly part), bounded and
remembered.

Bounded: one `Budget` per verdict, whatever number of states it looks at: at most MAX_ARCHIVE_BYTES of members
and MAX_CHECK_S of time, and no archive whose central directory lists more than MAX_MEMBERS entries is parsed (a
planted one of millions would take its time and memory before a byte of data is read). Remembered: an archive
read whole is kept by its identity, so the GET before a resume and the POST that starts it read it once.
"""
from __future__ import annotations

import lzma
import os
import struct
import threading
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from lora_worker.host import fs

# A state is ~257 MB at dim 16 and ~513 MB at dim 32 (AdamW8bit): 4 GiB of members and 120 s (at a slow
# disk's 50 MB/s, 6 GB) leave room for both, and bound what a planted archive can make a request read.
MAX_ARCHIVE_BYTES = 4 << 30
MAX_CHECK_S = 120.0
MAX_MEMBERS = 65535  # a torch zip of a state holds ~5,400 (one per optimizer tensor); past 65535 it needs zip64
CHUNK = 1 << 20
# What zipfile raises on bytes that are not an intact archive, beyond its BadZipFile: a member flagged encrypted
# (RuntimeError) or compressed by a method it lacks (NotImplementedError), a deflate, bzip2 or LZMA stream that
# does not decode (zlib.error, OSError, LZMAError), a record cut short (EOFError, struct.error), an offset past
# what a seek takes (OverflowError, ValueError). A power cut or a flipped bit gives any of them; each is the
# archive's refusal, `state_archive_corrupt` (tests/host/test_train_state_fuzz.py flips bits in real archives).
UNREADABLE = (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, NotImplementedError, zlib.error,
              lzma.LZMAError, struct.error, OverflowError)


class Refusal(Exception):
    """Why an archive is not used: a resume reason's code and its sentence."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Budget:
    """What one verdict may still read of archives, in bytes and time, whatever number of states it looks at."""

    deadline: float
    bytes_left: int
    clock: Callable[[], float]

    @classmethod
    def start(cls, clock: Callable[[], float] = time.monotonic) -> Budget:
        return cls(clock() + MAX_CHECK_S, MAX_ARCHIVE_BYTES, clock)

    def spent(self) -> bool:
        return self.clock() > self.deadline


# The archives that passed, by identity (as host/trainer.py keeps its tokenizer checks): reading a state's CRCs
# costs seconds, and each GET /train/<id>/resume and the POST after it asks again about the same files. A file
# changed in any way since (written, replaced, renamed over, truncated) has another inode, size or ctime, which no
# user can set back, so it is read again. Only passes are kept.
_INTACT: dict[tuple[int, int, int, int, int], None] = {}
_INTACT_MAX = 256
_INTACT_LOCK = threading.Lock()


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def members(fh: BinaryIO, name: str) -> list[zipfile.ZipInfo]:
    """The archive's central directory alone (the end of the file): a zip with members, whose directory lists at
    most MAX_MEMBERS of them. Refusal or one of UNREADABLE otherwise."""
    end = zipfile._EndRecData(fh)  # type: ignore[attr-defined]  # the end record zipfile itself reads first
    if end is None:
        raise zipfile.BadZipFile("no end of central directory")
    if end[zipfile._ECD_ENTRIES_TOTAL] > MAX_MEMBERS:  # type: ignore[attr-defined]
        raise Refusal("state_unverifiable", f"{name} lists more than {MAX_MEMBERS} members")
    fh.seek(0)
    listed = zipfile.ZipFile(fh).infolist()
    if not listed:
        raise Refusal("state_archive_corrupt", f"{name} is not an intact zip archive: no members")
    return listed


def read_through(dir_fd: int, name: str, budget: Budget) -> Refusal | None:
    """Read every member of the zip `name` in `dir_fd` to its end: zipfile checks each one's CRC-32 there
    (BadZipFile if wrong). None when it is intact (now, or by its identity before)."""
    if budget.spent():
        return Refusal("state_unverifiable", f"{name} was not read: the check's {MAX_CHECK_S:.0f} s were spent")
    try:
        fd, st = fs.open_regular(dir_fd, name)
        with os.fdopen(fd, "rb") as fh:
            with _INTACT_LOCK:
                if _identity(st) in _INTACT:
                    return None
            listed = members(fh, name)
            declared = sum(m.file_size for m in listed)
            if declared > budget.bytes_left:
                return Refusal("state_unverifiable", f"{name} has more than {MAX_ARCHIVE_BYTES} bytes of members in "
                               "all (with the archives read before it)")
            budget.bytes_left -= declared
            fh.seek(0)
            with zipfile.ZipFile(fh) as archive:
                for member in listed:
                    with archive.open(member) as stream:
                        while stream.read(CHUNK):
                            if budget.spent():
                                return Refusal("state_unverifiable",
                                               f"{name} was not read whole within {MAX_CHECK_S:.0f} s")
        _keep_intact(st)
        return None
    except Refusal as exc:
        return exc
    except UNREADABLE as exc:
        return Refusal("state_archive_corrupt", f"{name} is not an intact zip archive: {type(exc).__name__}: {exc}")


def _keep_intact(st: os.stat_result) -> None:
    with _INTACT_LOCK:
        if len(_INTACT) >= _INTACT_MAX:
            _INTACT.clear()
        _INTACT[_identity(st)] = None

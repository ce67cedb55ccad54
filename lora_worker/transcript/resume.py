"""A run log taken up again by a process that did not create it: a restarted Slurm poller appends to the log
its predecessor wrote, so a client following it with `?offset=` never sees an offset go back.

`ResumedLog` is a JobLog over the existing head (and tail) file, opened for append without following a link;
it creates the head file (exclusively) if there is none. While `muted`, what it is fed is collapsed and
returned as usual (the error tail is rebuilt from it) but not written: the output its predecessor already
wrote is parsed again, not logged again.
"""
from __future__ import annotations

import os
from pathlib import Path

from lora_worker.transcript.logfile import TAIL_HEADER, JobLog, log_paths

APPEND = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


class ResumedLog(JobLog):
    def __init__(self, log_dir: Path, job_id: int, *, head_bytes: int, tail_bytes: int) -> None:  # noqa: PLW0231
        log_dir.mkdir(parents=True, exist_ok=True)
        self.head_path, self.tail_path = log_paths(log_dir, job_id)
        self.head_bytes, self.tail_bytes = head_bytes, tail_bytes
        try:
            fd = os.open(self.head_path, APPEND)
        except FileNotFoundError:
            fd = os.open(self.head_path, APPEND | os.O_CREAT | os.O_EXCL, 0o640)
        self._head = os.fdopen(fd, "ab")
        self._head_size = os.fstat(fd).st_size
        self._tail = None
        self._tail_start = 0
        self._tail_size = 0
        self._resume_tail()
        self._open = b""
        self._redraw_dirty = False
        self._redraw_at = None  # the first tick starts it, in the ticker's clock (JobLog)
        self.write_errors = 0
        self.muted = False

    broken = False

    def _resume_tail(self) -> None:
        try:
            fd = os.open(self.tail_path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        header = os.pread(fd, 64, 0).split(b"\n", 1)[0] + b"\n"
        found = TAIL_HEADER.match(header)
        if found is None:  # not a tail this module wrote: left alone, and nothing is written over it
            os.close(fd)
            self.broken = True
            return
        self._tail = os.fdopen(fd, "ab")
        self._tail_start = int(found.group(1))
        self._tail_size = os.fstat(fd).st_size - len(header)

    def _write(self, data: bytes) -> None:
        if not (self.muted or self.broken):
            super()._write(data)


def resumed(log_dir: Path, job_id: int) -> bool:
    """Whether a run log of this job exists already (a resumed follower appends to it)."""
    return log_paths(log_dir, job_id)[0].exists()

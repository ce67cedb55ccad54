"""The job's run log: trainer output with tqdm redraws collapsed, bounded in size, keeping head and tail.

On disk, under the state directory's logs/:
  job-<id>.log       the first `head_bytes` of the log, never rewritten once full;
  job-<id>.tail.log  only for long logs: a first line `# lora-worker log tail from byte <S>` and then the log
                     from logical byte S on. When it passes 2 x `tail_bytes` it is rewritten (atomically, by
                     rename) to its last `tail_bytes`, and S moves on.
Offsets in the API are logical (bytes since the start of the log), so a client following with `?offset=`
never sees bytes twice; if it falls behind a rewrite, it is told how many bytes it skipped.

Every file here is opened with host/fs.py's `open_in`: logs/ itself and the file are never followed as links,
and a FIFO or anything but a regular file is refused at once (OSError) instead of blocking a request thread.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import BinaryIO

from lora_worker.host import fs

TAIL_HEADER = re.compile(rb"^# lora-worker log tail from byte (\d+)\n")
REDRAW_EVERY_S = 30.0  # how often a still-open progress bar is copied into the log as a line


def log_paths(log_dir: Path, job_id: int) -> tuple[Path, Path]:
    return log_dir / f"job-{job_id}.log", log_dir / f"job-{job_id}.tail.log"


def _create_new(head: Path, tail: Path):  # type: ignore[no-untyped-def]
    """The head file, created by us now (O_EXCL, no link followed): a run log never receives a second job's
    output. Job ids are never reused (migration 0007, `seed_job_ids`); should a log of the same name exist
    anyway, it belongs to another run and is moved aside with its tail, kept, and never written again."""
    while True:
        try:
            return os.fdopen(open_log(head, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND), "ab")
        except FileExistsError:
            suffix = f".replaced-{time.time_ns()}"
            for path in (head, tail):
                try:
                    os.rename(path, path.with_name(path.name + suffix))
                except FileNotFoundError:
                    pass


def append_note(log_dir: Path, job_id: int, message: str, *, head_bytes: int) -> None:
    """One closing line of our own, written after the supervisor is gone (by reconcile, saying what it found
    and did), in the layout JobLog keeps: at the end of the tail file if there is one, else of the head file
    while it has room, else in a new tail file. OSError if the log cannot be written."""
    head, tail = log_paths(log_dir, job_id)
    log_dir.mkdir(parents=True, exist_ok=True)
    data = f"[lora-worker] {message}\n".encode("utf-8", "replace")
    append = os.O_WRONLY | os.O_APPEND
    if os.path.lexists(tail):
        path, flags, prefix = tail, append, b""
    elif (size := log_size(head)) and size + len(data) <= head_bytes:
        path, flags, prefix = head, append, b""
    elif size:
        path, flags, prefix = tail, append | os.O_CREAT | os.O_EXCL, _tail_header(size)
    else:  # the supervisor never opened it: the closing line is the whole log
        path, flags, prefix = head, append | os.O_CREAT | os.O_EXCL, b""
    fd = open_log(path, flags)
    try:
        os.write(fd, prefix + data)
    finally:
        os.close(fd)


class JobLog:
    """Append-only writer used by the supervisor, of a log file it created itself. Write errors (a full disk)
    never stop supervision.

    It takes the output as bytes and writes each chunk's complete lines in one write, each line collapsed to what
    a terminal would show (`collapse_redraws`); the line still open is kept as its newest non-blank segment and
    its last one, all a later collapse can need, so a run of redraws never piles up. Nothing is decoded but the
    segments a collapse keeps; what is written is valid UTF-8 (bad bytes replaced, as the API reads them)."""

    def __init__(self, log_dir: Path, job_id: int, *, head_bytes: int, tail_bytes: int) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.head_path, self.tail_path = log_paths(log_dir, job_id)
        self.head_bytes, self.tail_bytes = head_bytes, tail_bytes
        self._head = _create_new(self.head_path, self.tail_path)
        self._head_size = 0
        self._tail: BinaryIO | None = None
        self._tail_start = 0
        self._tail_size = 0
        self._open = b""  # the open line: the newest redraw of a bar, or a line still without its newline
        self._redraw_dirty = False
        # In the clock of whoever ticks (the runner's, a poller's, a test's fake one), so it starts at the first
        # tick: a time taken here from time.monotonic() would be compared with another clock's readings.
        self._redraw_at: float | None = None
        self.write_errors = 0

    def feed(self, data: bytes | str) -> bytes:
        """Add output; its complete lines are written, each keeping only its last non-blank `\\r` segment.
        Returns what was written (the error tail is taken from it)."""
        if isinstance(data, str):
            data = data.encode("utf-8", "replace")
        last = data.rfind(b"\n")
        if last < 0:
            self._hold(self._open + data)
            return b""
        first = data.find(b"\n")
        pieces: list[bytes | memoryview] = [_collapse(self._open + data[:first], 0, first + len(self._open)), b"\n"]
        _collapse_lines(data, first + 1, last + 1, pieces)
        self._hold(data[last + 1:])
        written = _valid_utf8(b"".join(pieces))
        self._write(written)
        return written

    def tick(self, now: float | None = None) -> None:
        """Copy an open progress bar into the log now and then, so the log shows a long run moving."""
        now = time.monotonic() if now is None else now
        if self._redraw_at is None:
            self._redraw_at = now
        if self._redraw_dirty and now - self._redraw_at >= REDRAW_EVERY_S:
            cr = self._open.rfind(b"\r")
            bar = self._open[cr + 1:].decode("utf-8", "replace").rstrip() if cr >= 0 else ""
            if bar.strip():
                self._write(bar.encode() + b"\n")
            self._redraw_dirty = False
            self._redraw_at = now

    def note(self, message: str) -> None:
        """A line of our own, marked so it is never mistaken for trainer output."""
        self._write(f"[lora-worker] {message}\n".encode("utf-8", "replace"))

    def end_of_output(self) -> None:
        """The trainer is gone: a last line left without its newline (a killed bar) is written as it is."""
        line = _collapse(self._open, 0, len(self._open)).decode("utf-8", "replace").rstrip()
        if line:
            self._write(line.encode() + b"\n")
        self._open = b""

    def close(self) -> None:
        self.end_of_output()
        for fh in (self._head, self._tail):
            if fh is not None:
                try:
                    fh.close()
                except OSError:
                    self.write_errors += 1

    def _hold(self, line: bytes) -> None:
        """Keep the open line, less the segments no collapse can pick any more."""
        cr = line.rfind(b"\r")
        if cr >= 0:
            self._redraw_dirty = True
            keep = _last_non_blank(line, 0, cr)
            line = (line[keep[0]:keep[1]] if keep else b"") + line[cr:]
        self._open = line[-65536:]

    def _write(self, data: bytes) -> None:
        try:
            if self._tail is None and self._head_size + len(data) <= self.head_bytes:
                self._head.write(data)
                self._head.flush()
                self._head_size += len(data)
                return
            if self._tail is None:
                self._open_tail()
            assert self._tail is not None
            self._tail.write(data)
            self._tail.flush()
            self._tail_size += len(data)
            if self._tail_size > 2 * self.tail_bytes:
                self._compact()
        except OSError:
            self.write_errors += 1

    def _open_tail(self) -> None:
        self._tail_start = self._head_size
        self._tail = os.fdopen(open_log(self.tail_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb")
        self._tail.write(_tail_header(self._tail_start))
        self._tail.flush()

    def _compact(self) -> None:
        assert self._tail is not None
        self._tail.close()
        tmp = self.tail_path.with_suffix(".tmp")
        try:
            with os.fdopen(open_log(self.tail_path), "rb") as fh:
                header = fh.readline()
                fh.seek(len(header) + self._tail_size - self.tail_bytes)
                body = fh.read()
            # Start the kept part at a line boundary so the tail reads cleanly.
            newline = body.find(b"\n")
            body = body[newline + 1:] if 0 <= newline < len(body) - 1 else body
            start = self._tail_start + self._tail_size - len(body)
            with os.fdopen(open_log(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as out:
                out.write(_tail_header(start) + body)
            os.replace(tmp, self.tail_path)
            self._tail_start, self._tail_size = start, len(body)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk: the tail grows on uncompacted, and compaction is retried
            raise
        finally:
            # Whatever happened above, the log stays writable.
            self._tail = os.fdopen(open_log(self.tail_path, os.O_WRONLY | os.O_APPEND), "ab")


def collapse_redraws(line: str) -> str:
    """The last non-empty `\\r` segment of a line, right-stripped: what a terminal would show. The run log and
    the tail quoted in an error message both keep exactly this."""
    if "\r" not in line:
        return line
    for segment in reversed(line.split("\r")):
        if segment.strip():
            return segment.rstrip()
    return ""


def _collapse(data: bytes, lo: int, hi: int) -> bytes:
    """`collapse_redraws` of the line data[lo:hi], on bytes: only the segment it keeps is decoded."""
    if data.find(b"\r", lo, hi) < 0:
        return data[lo:hi]
    keep = _last_non_blank(data, lo, hi)
    return data[keep[0]:keep[1]].decode("utf-8", "replace").rstrip().encode() if keep else b""


def _last_non_blank(data: bytes, lo: int, hi: int) -> tuple[int, int] | None:
    """Where the last `\\r` segment of data[lo:hi] that is not blank lies."""
    end = hi
    while end >= lo:
        cr = data.rfind(b"\r", lo, end)
        start = cr + 1 if cr >= 0 else lo
        segment = data[start:end]
        if segment.strip() and segment.decode("utf-8", "replace").strip():
            return start, end
        if cr < 0:
            return None
        end = cr
    return None


def _collapse_lines(data: bytes, lo: int, hi: int, pieces: list[bytes | memoryview]) -> None:
    """The complete lines data[lo:hi] (it ends in \\n), collapsed, appended to `pieces`: lines without a `\\r`
    in runs as they are, each line of redraws on its own."""
    pos = lo
    while pos < hi:
        cr = data.find(b"\r", pos, hi)
        if cr < 0:
            pieces.append(memoryview(data)[pos:hi])  # copied once, by the join
            return
        start = data.rfind(b"\n", pos, cr) + 1 or pos
        end = data.find(b"\n", cr, hi)
        if start > pos:
            pieces.append(memoryview(data)[pos:start])
        pieces.append(_collapse(data, start, end))
        pieces.append(b"\n")
        pos = end + 1


def _valid_utf8(data: bytes) -> bytes:
    if data.isascii():
        return data
    try:
        data.decode()
        return data
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace").encode()


def _tail_header(start: int) -> bytes:
    return f"# lora-worker log tail from byte {start}\n".encode()


def open_log(path: Path, flags: int = os.O_RDONLY) -> int:
    """A file of the log dir: never through a link, never blocking, a regular file or OSError."""
    return fs.open_in(path.parent, path.name, flags)


def log_size(path: Path) -> int:
    try:
        fd = open_log(path)
    except FileNotFoundError:
        return 0
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)

"""The job's run log, read: by logical offset (what `?offset=` follows) or as its last lines, while the
supervisor writes it. The layout (head file, tail file and its header) is transcript/logfile.py's, which writes it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from lora_worker.transcript.logfile import TAIL_HEADER, log_paths, log_size, open_log


@dataclass(frozen=True)
class LogChunk:
    text: str
    offset: int  # the logical offset just past `text`; pass it back to continue
    skipped: int = 0  # bytes a follower missed because the tail was rewritten past its offset


class LogReader:
    """Reads a job log by logical offset or as its last lines; works while the supervisor writes."""

    def __init__(self, log_dir: Path, job_id: int) -> None:
        self.head_path, self.tail_path = log_paths(log_dir, job_id)

    def exists(self) -> bool:
        return os.path.lexists(self.head_path)

    def size(self) -> int:
        with _TailView(self.tail_path) as tail:
            return tail.start + tail.body_size if tail.present else log_size(self.head_path)

    def read_from(self, offset: int, limit: int) -> LogChunk:
        offset, out, skipped = max(0, offset), b"", 0
        head_size = log_size(self.head_path)
        if offset < head_size:
            out = _read_range(self.head_path, offset, min(limit, head_size - offset))
            offset += len(out)
        # One open file for the tail's layout and its bytes: a rewrite by rename cannot mix two versions.
        with _TailView(self.tail_path) as tail:
            if tail.present and len(out) < limit and offset >= head_size:
                if offset < tail.start:
                    skipped, offset = tail.start - offset, tail.start
                data = tail.read(offset - tail.start, limit - len(out))
                out += data
                offset += len(data)
        whole = _whole_characters(out)  # a limit can fall inside a character: leave it to the next read
        return LogChunk(text=whole.decode("utf-8", "replace"), offset=offset - (len(out) - len(whole)),
                        skipped=skipped)

    def tail_lines(self, lines: int, max_bytes: int = 1 << 20) -> LogChunk:
        size = self.size()
        begin = max(0, size - max_bytes)
        chunk = self.read_from(begin, size - begin)
        kept = chunk.text.splitlines()[-lines:] if lines > 0 else []
        return LogChunk(text="\n".join(kept) + ("\n" if kept else ""), offset=chunk.offset)


class _TailView:
    """The tail file opened once: its logical start, body size, and reads relative to the body."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.present, self.start, self.body_size, self._header_len = False, 0, 0, 0
        self._fh: BinaryIO | None = None

    def __enter__(self) -> _TailView:
        try:
            self._fh = os.fdopen(open_log(self.path), "rb")
        except FileNotFoundError:
            return self
        header = self._fh.readline()
        m = TAIL_HEADER.match(header)
        if m:
            self._fh.seek(0, 2)
            self.present, self.start = True, int(m[1])
            self._header_len, self.body_size = len(header), self._fh.tell() - len(header)
        return self

    def read(self, body_offset: int, length: int) -> bytes:
        if self._fh is None or length <= 0:
            return b""
        self._fh.seek(self._header_len + body_offset)
        return self._fh.read(length)

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            self._fh.close()


def _whole_characters(data: bytes) -> bytes:
    """`data` less a UTF-8 sequence cut short at its end."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        if lead & 0xC0 != 0x80:  # not a continuation byte: where the last character starts
            length = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            return data if length <= back else data[:-back]
    return data



def _read_range(path: Path, offset: int, length: int) -> bytes:
    if length <= 0:
        return b""
    with os.fdopen(open_log(path), "rb") as fh:
        fh.seek(offset)
        return fh.read(length)

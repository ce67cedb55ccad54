"""Terminal escapes taken out of the trainer's byte stream (rich's colours, tqdm's cursor moves), and bytes made
text for a reader that wants text. Used by the parser (transcript/parser.py) and the output (transcript/output.py).
"""
from __future__ import annotations

import codecs
import re

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
ANSI_OPEN = re.compile(rb"\x1b(?:\[[0-9;?]*)?\Z")  # an escape the chunk cut: its end comes with the next chunk
MAX_HELD_ESCAPE = 64


class AnsiFilter:
    """Terminal escapes taken out of the byte stream, an escape cut between two chunks included (its start is
    held back until the rest arrives)."""

    def __init__(self) -> None:
        self._held = b""

    def strip(self, data: bytes) -> bytes:
        if self._held:
            data, self._held = self._held + data, b""
        if b"\x1b" not in data:
            return data
        cut = ANSI_OPEN.search(data, max(0, len(data) - MAX_HELD_ESCAPE))
        if cut is not None:
            data, self._held = data[:cut.start()], data[cut.start():]
        return ANSI.sub(b"", data)

    def flush(self) -> bytes:
        """At end of output: an escape never finished is text."""
        held, self._held = self._held, b""
        return held


class Decoder:
    """Bytes to text, for a reader that wants text: ANSI removed (even when cut), UTF-8 kept whole across cuts,
    bad bytes replaced."""

    def __init__(self) -> None:
        self._ansi = AnsiFilter()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def decode(self, data: bytes, final: bool = False) -> str:
        data = self._ansi.strip(data)
        if final:
            data += self._ansi.flush()
        return self._decoder.decode(data, final)

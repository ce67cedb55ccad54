"""The trainer's output as the supervisor takes it in: bytes from the merged stdout+stderr pipe, parsed, written
to the run log, and its last lines kept for an error message.

Everything works on the bytes as they come (transcript/parser.py, transcript/logfile.py): each chunk is parsed
and logged at once, whatever its cuts, and costs a few C-level passes, so nothing needs to wait for a later chunk.
Only what is kept is decoded: the segments the parser reads, the lines the log keeps of a run of redraws, and the error
tail when someone asks for it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from lora_worker.states import Phase
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.parser import AnsiFilter, Parser, Progress

TAIL_LINES = 200
TAIL_KEEP_BYTES = 256 * 1024  # what the tail keeps of older chunks: 200 lines, unless they are very long


class TrainerOutput:
    """Feed it what the pipe gives; it keeps `progress`, the run log and the tail current.

    `on_output(phase_before, step_before)` is called after each chunk is parsed, so the caller can tell life
    from silence and a new step from a redraw of the old one.
    """

    def __init__(self, joblog: JobLog, on_output: Callable[[Phase, int], None], step_offset: int = 0) -> None:
        self.joblog = joblog
        self.on_output = on_output
        self.ansi = AnsiFilter()
        self.parser = Parser(step_offset)  # a resume's first step (the row's resume_step)
        self.changed = False  # the progress moved since the caller last cleared this
        self.ended = False  # the output reached its end: every file the trainer wrote is complete or never will be
        # What the log wrote, newest last: byte blocks of whole lines, and our own notes. Decoded on demand.
        self._recent: deque[bytes | str] = deque()
        self._recent_bytes = 0

    @property
    def progress(self) -> Progress:
        return self.parser.progress

    @property
    def tail(self) -> list[str]:
        """The last lines of the log as it was written (redraws collapsed, blank lines left out, right-stripped),
        our notes among them: what an error message quotes."""
        lines: list[str] = []
        for item in reversed(self._recent):
            if isinstance(item, str):
                lines.append(item)
            else:
                lines.extend(line.rstrip() for line in reversed(
                    item.decode("utf-8", "replace").split("\n")[:-1]) if line.strip())
            if len(lines) >= TAIL_LINES:
                break
        return lines[:TAIL_LINES][::-1]

    def consume(self, data: bytes, now: float) -> None:
        data = self.ansi.strip(data)
        if data:
            self._take(data)

    def tick(self, now: float) -> None:
        self.joblog.tick(now)

    def end(self) -> None:
        """The pipe reached EOF: parse what is left, including a last line without its newline."""
        if held := self.ansi.flush():
            self._take(held)
        self.changed |= self.parser.close()
        self.ended = True
        self.joblog.end_of_output()

    def note(self, message: str) -> None:
        """A line of the supervisor's own, in the run log and in the tail an error message quotes."""
        self.joblog.note(message)
        self._remember(f"[lora-worker] {message}"[:1000])

    def _take(self, data: bytes) -> None:
        phase, step = self.parser.progress.phase, self.parser.progress.step
        self.changed |= self.parser.feed(data)
        if written := self.joblog.feed(data):
            self._remember(written)
        self.on_output(phase, step)

    def _remember(self, item: bytes | str) -> None:
        self._recent.append(item)
        self._recent_bytes += len(item)
        # Older blocks go once the newer ones hold enough; a block holds at least one line.
        while len(self._recent) > TAIL_LINES or (
                len(self._recent) > 1 and self._recent_bytes - len(self._recent[-1]) > TAIL_KEEP_BYTES):
            self._recent_bytes -= len(self._recent.popleft())

"""The trainer's output as the supervisor takes it in: bytes from the merged stdout+stderr pipe, decoded and
parsed, written to the run log, and its last lines kept for an error message.

A run of tqdm redraws is not parsed redraw by redraw: each overwrites the last on the same line, so only the
newest can matter to the parser, the log or a client. Its bytes are kept and parsed once, a moment later, or
first thing before the next line (a phase line must follow the redraw written before it).
"""
from __future__ import annotations

from collections.abc import Callable

from lora_worker.states import Phase
from lora_worker.run.logfile import JobLog, collapse_redraws
from lora_worker.run.parser import Decoder, Parser, Progress

MATERIALIZE_S = 0.05  # how long the newest redraw may wait to be parsed (real steps are 0.2 s or more apart)
TAIL_LINES = 200


class TrainerOutput:
    """Feed it what the pipe gives; it keeps `progress`, the run log and the tail current.

    `on_output(phase_before, step_before)` is called after each piece of text is parsed, so the caller can
    tell life from silence and a new step from a redraw of the old one.
    """

    def __init__(self, joblog: JobLog, on_output: Callable[[Phase, int], None]) -> None:
        self.joblog = joblog
        self.on_output = on_output
        self.decoder = Decoder()
        self.parser = Parser()
        self.tail: list[str] = []
        self.changed = False  # the progress moved since the caller last cleared this
        self._latest: bytes | None = None  # the newest redraw, not parsed yet
        self._latest_since = 0.0
        self._pending_line = ""

    @property
    def progress(self) -> Progress:
        return self.parser.progress

    def consume(self, data: bytes, now: float) -> None:
        cut = data.rfind(b"\r") if b"\n" not in data else -1
        if cut >= 0:
            if self._latest is None:
                self._latest_since = now
            self._latest = data[cut:]
            self.decoder.reset()  # a partial character before the cut belonged to overwritten text
            return
        self._materialize()
        self._feed(self.decoder.decode(data))

    def tick(self, now: float) -> None:
        if self._latest is not None and now - self._latest_since >= MATERIALIZE_S:
            self._materialize()
        self.joblog.tick(now)

    def end(self) -> None:
        """The pipe reached EOF: parse what is left, including a last line without its newline."""
        self._materialize()
        self._feed(self.decoder.decode(b"", final=True))
        self.parser.close()
        self.joblog.end_of_output()

    def note(self, message: str) -> None:
        """A line of the supervisor's own, in the run log and in the tail an error message quotes."""
        self.joblog.note(message)
        self._keep(f"[lora-worker] {message}"[:1000])

    def _materialize(self) -> None:
        if self._latest is not None:
            latest, self._latest = self._latest, None
            self._feed(self.decoder.decode(latest))

    def _feed(self, text: str) -> None:
        if not text:
            return
        phase, step = self.parser.progress.phase, self.parser.progress.step
        self.changed |= self.parser.feed(text)
        self.joblog.feed(text)
        self._remember(text)
        self.on_output(phase, step)

    def _remember(self, text: str) -> None:
        # The last lines, collapsed like the log, for the error message of a failed run.
        lines = (self._pending_line + text).split("\n")
        self._pending_line = lines.pop()[-4096:]
        for line in lines:
            segment = collapse_redraws(line)
            if segment.strip():
                self._keep(segment.rstrip())

    def _keep(self, line: str) -> None:
        self.tail.append(line)
        del self.tail[:-TAIL_LINES]

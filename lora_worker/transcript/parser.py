"""Incremental, pure parser of sd-scripts output: phase, step/total, avr_loss, rate, ETA, and failure markers.

The trainer's progress is tqdm's `steps` bar on stderr, redrawn with `\\r` even off a TTY; log lines arrive on
stdout with --console_log_simple. Both come through one pipe, in the order they were written. Chunks are cut
anywhere, a log line may be glued onto a redraw, and a redraw may end in pad spaces. So the output is split
into segments on `\\r` and `\\n`. A marker (a phase, `model saved.`, a failure) counts only where it begins a
segment's message (MARKERS, LINE_PREFIX): the trainer echoes paths and captions.

The parser works on bytes, at the cost of a few C-level passes per chunk, never a Python step per redraw or
per log line: a run of redraws is looked at only for segments that hold a guard character (MARKER_GUARD) and
for the newest redraw of each step (`_bars`); a run of log lines only where a marker can begin a message
(CANDIDATES). Only what is kept is decoded. Every segment is parsed once, when it ends, in stream order, so
the result is the same however the pipe cut the stream (tests/transcript/test_stream.py); bench/stream.py
measures the cost. What a marker is lives in transcript/markers.py, what a redraw is in transcript/redraws.py.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from lora_worker.states import Phase
from lora_worker.transcript.ansi import AnsiFilter, Decoder  # re-exported: the parser's readers take them here
from lora_worker.transcript.markers import (
    FLAG_GROUPS,
    LINE_MARKER,
    MARKER_GUARD_BYTES,
    PHASE_GROUPS,
    SAVE_GROUPS,
    line_end,
    message_starts,
)
from lora_worker.transcript.redraws import (BAR, MAX_COUNT, MAX_SEGMENT, STEPS, bar_before, count, counts, loss,
                                            newest_bar, rate, seconds, segment_end)

__all__ = ["AnsiFilter", "Decoder", "Parser", "Progress", "Save"]

MAX_PENDING = MAX_SEGMENT  # a stream that never ends a segment must not grow without bound: its head is kept
MAX_SIGNAL, MAX_STATUS = 127, 255  # a signal number (SIGRTMAX is 64) and an exit status
# The numbers a marker carries, and the most each may be: a line whose number is past it is not the trainer's.
COUNTED = {"total_steps": MAX_COUNT, "state_step": MAX_COUNT, "signum": MAX_SIGNAL, "inner_rc": MAX_STATUS}


@dataclass(frozen=True)
class Save:
    """A save the trainer announced: `kind` is its marker's name (markers.SAVE_GROUPS), `text` its argument (a
    path, a step), `redraws` how many `steps` redraws came before it (a later one means the save is done)."""

    kind: str
    text: str
    redraws: int


@dataclass
class Progress:
    """What the trainer has told us so far."""

    phase: Phase = Phase.LAUNCHING
    # Every phase entered, in order, launching left out: two markers in one read (output not unbuffered, or
    # the Slurm poller's read of a whole cycle) still pass two phases. The ledger records each once.
    phases: list[Phase] = field(default_factory=list)
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    rate: float | None = None  # optimizer steps per second
    eta_s: float | None = None  # tqdm's remaining time (average since start, warm-up included)
    flags: set[str] = field(default_factory=set)  # marker names seen: model_saved, cuda_oom, …
    signal: int | None = None  # from the launcher's "died with <Signals.SIGKILL: 9>"
    nan_at: int | None = None  # the first step whose avr_loss was NaN: the run learns nothing from there on
    inner_exit: int | None = None  # the trainer's own exit status, from the launcher's message
    checkpoints: list[str] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)  # every save line, in order
    passes: list[tuple[int, int]] = field(default_factory=list)  # each sample pass begun: (its step, redraws)
    redraws: int = 0  # `steps` redraws applied so far

    def enter(self, phase: Phase) -> None:
        if phase is not self.phase:
            self.phase = phase
            self.phases.append(phase)


class Parser:
    """Feed it the output (bytes, or text); it keeps `progress` current and collects each step's loss."""

    def __init__(self, step_offset: int = 0) -> None:
        # A resume's first step: sd-scripts' bar then counts the steps left from 0 (`range(max_train_steps -
        # initial_step)`, train_network.py L1357), and the job's step is the state's plus the bar's.
        self.step_offset = step_offset
        self.progress = Progress()
        self._open = b""  # the segment still open: the bytes since the last \r or \n
        self._last_bar = ""
        self._points: dict[int, float | None] = {}

    def feed(self, data: bytes | str) -> bool:
        """Parse a chunk; True if the progress changed."""
        if isinstance(data, str):
            data = data.encode("utf-8", "replace")
        before = self._snapshot()
        cr, nl = data.rfind(b"\r"), data.rfind(b"\n")
        if cr < 0 and nl < 0:
            self._open += data[:MAX_PENDING - len(self._open)]
        else:
            first = _first_break(data, cr, nl)
            # the segment the last chunk left open ends here
            self._segment(self._open + data[:max(0, min(first, MAX_PENDING - len(self._open)))])
            end = max(cr, nl) + 1
            self._region(data, first + 1, end)
            self._open = data[end:end + MAX_PENDING]
        if self._open.startswith(STEPS):
            # A complete redraw counts before its segment ends: tqdm's newest is the open one.
            self._bar(self._open.decode("utf-8", "replace"))
        return self._snapshot() != before

    def close(self) -> bool:
        """End of output: whatever was left without a line end is parsed as a last line."""
        return self.feed(b"\n") if self._open else False

    def take_points(self) -> list[tuple[int, float | None]]:
        """The (step, loss) pairs seen since the last call."""
        points, self._points = sorted(self._points.items()), {}
        return points

    # -- the stream, in segments ---------------------------------------------------------------------------

    def _segment(self, seg: bytes) -> None:
        """One whole segment, on its own: its redraw, then its markers. Of a segment longer than MAX_PENDING only
        its head counts, however it arrived (a marker or a redraw begins a segment)."""
        seg = seg[:MAX_PENDING]
        if seg.startswith(STEPS):
            self._bar(seg.decode("utf-8", "replace"))
        if any(g in seg for g in MARKER_GUARD_BYTES):
            self._scan_markers(seg.decode("utf-8", "replace"))

    def _region(self, data: bytes, lo: int, hi: int) -> None:
        """The whole segments of data[lo:hi] (each ends in \\r or \\n; lo starts one), in order: those that may
        hold a marker one by one, and of the redraws between them only each step's newest."""
        pos = lo
        for start, end in self._candidates(data, lo, hi):
            self._bars(data, pos, start)
            self._segment(data[start:end])
            pos = end + 1
        self._bars(data, pos, hi)

    def _candidates(self, data: bytes, lo: int, hi: int) -> list[tuple[int, int]]:
        """Where the segments that may hold a marker lie in data[lo:hi], in order: in a line of redraws, those
        holding a guard character; in a run of log lines, those where a marker can begin the message."""
        found: list[tuple[int, int]] = []
        pos = lo
        while pos < hi:
            cr = data.find(b"\r", pos, hi)
            start = hi if cr < 0 else data.rfind(b"\n", pos, cr) + 1 or pos
            if start > pos:
                found += ((s, data.find(b"\n", s, start)) for s in message_starts(data, pos, start))
            if cr < 0:
                break
            end = data.find(b"\n", cr, hi) + 1 or hi
            while (guard := min((at for g in MARKER_GUARD_BYTES if (at := data.find(g, start, end)) >= 0),
                                default=-1)) >= 0:
                found.append((_segment_start(data, guard, start), segment_end(data, guard, end)))
                start = found[-1][1] + 1
            pos = end
        return found

    def _bars(self, data: bytes, lo: int, hi: int) -> None:
        """The `steps` redraws of data[lo:hi] (whole segments, none holding a marker): for each step, its newest
        redraw is applied, in order. They are found from the newest back, a step at a time (`bar_before`), so a
        run of hundreds of redraws costs a few comparisons per step, not a parse of each redraw."""
        newest_first: list[re.Match[str]] = []
        found = newest_bar(data, lo, hi)
        while found is not None:
            at, m = found
            newest_first.append(m)
            found = bar_before(data, lo, at, m)
        for m in reversed(newest_first):
            self._apply(m)

    def _bar(self, text: str) -> None:
        m = BAR.match(text)
        if m is not None:
            self._apply(m)

    def _apply(self, m: re.Match[str]) -> None:
        # A redraw already applied while its segment was open is not applied again when the segment ends. Text
        # shaped like the bar but no bar (counts) is passed over first, as the run of redraws passes over it:
        # it is never the redraw applied last.
        if (counted := counts(m)) is None or m[0] == self._last_bar:
            return
        self._last_bar = m[0]
        step, total = counted
        p = self.progress
        p.redraws += 1
        p.step, p.total_steps = step + self.step_offset, total + self.step_offset
        p.eta_s = seconds(m[4])
        p.rate = rate(m[5], m[6])
        if (value := loss(m[7])) is not None:
            p.loss = value
            if p.nan_at is None and math.isnan(p.loss):
                p.nan_at = p.step
        if "model_saved" not in p.flags:
            # After a mid-run save the next redraw means training resumed.
            p.enter(Phase.TRAINING)
        if p.step > 0:
            self._points[p.step] = p.loss

    def _scan_markers(self, text: str) -> None:
        """The marker that begins a line's message, on each line of `text` (a segment is one): only there, after
        LINE_PREFIX. A marker quoted inside another line (a path, a caption, an exception's message) is data;
        the rest of a marker's line is its argument, never another marker."""
        pos = 0
        while pos <= len(text):
            m = LINE_MARKER.match(text, pos)
            if m is not None:
                self._apply_marker(m)
            pos = line_end(text, pos) + 1

    def _apply_marker(self, m: re.Match[str]) -> None:
        p = self.progress
        kind = m.lastgroup
        if not _counted(m):
            return  # a number no trainer prints (digits of another script, or too many): not the trainer's line
        if kind in SAVE_GROUPS:
            p.saves.append(Save(str(kind), _save_text(m, p.step), p.redraws))
        if kind in PHASE_GROUPS:
            self._phase(str(kind), m)
        elif kind == "total":
            p.total_steps = count(m["total_steps"])
        elif kind in FLAG_GROUPS:
            self._flag(str(kind), m)

    def _phase(self, kind: str, m: re.Match[str]) -> None:
        if "model_saved" not in self.progress.flags:
            self.progress.enter(PHASE_GROUPS[kind])
        if kind == "saving":
            self.progress.checkpoints.append(m["checkpoint"].strip())
        elif kind == "sampling":
            self.progress.passes.append((int(m["sample_step"]), self.progress.redraws))

    def _flag(self, kind: str, m: re.Match[str]) -> None:
        p = self.progress
        p.flags.add(kind)
        if kind == "model_saved":
            # The final save is done. Under rich logging without PYTHONUNBUFFERED its `saving
            # checkpoint:` print can reach the pipe after this line: the phase is `saving` either way.
            p.enter(Phase.SAVING)
        elif kind == "died":
            p.signal = count(m["signum"], MAX_SIGNAL)
        elif kind == "inner_exit":
            p.inner_exit = count(m["inner_rc"], MAX_STATUS)

    def _snapshot(self) -> tuple[object, ...]:
        p = self.progress
        loss = None if p.loss is None or math.isnan(p.loss) else p.loss
        return (p.phase, p.step, p.total_steps, loss, p.loss is not None and math.isnan(p.loss), p.rate,
                p.eta_s, len(p.flags), len(p.saves), len(p.passes))

def _save_text(m: re.Match[str], step: int) -> str:
    """A save marker's argument: the path or step it names (`saving last state.` names none: the bar's step)."""
    arg = m["checkpoint"] or m["state_step"] or m["removed_path"] or m["removed_state_path"] or (
        str(step) if m.lastgroup == "last_state" else "")
    return arg.strip()


def _counted(m: re.Match[str]) -> bool:
    """Whether each number the marker carries is one the trainer could print (COUNTED)."""
    return all(m[group] is None or count(m[group], limit) is not None for group, limit in COUNTED.items())


def _first_break(data: bytes, last_cr: int, last_nl: int) -> int:
    """Where the first segment of `data` ends (its first \r or \n), given that it has one."""
    cr = data.find(b"\r") if last_cr >= 0 else -1
    nl = data.find(b"\n", 0, cr if cr >= 0 else len(data)) if last_nl >= 0 else -1
    return nl if nl >= 0 else cr


def _segment_start(data: bytes, pos: int, lo: int) -> int:
    return max(data.rfind(b"\r", lo, pos), data.rfind(b"\n", lo, pos)) + 1 or lo

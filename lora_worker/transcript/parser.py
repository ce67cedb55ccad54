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
measures the cost.
"""
from __future__ import annotations

import codecs
import math
import re
from dataclasses import dataclass, field

from lora_worker.states import Phase

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
ANSI_OPEN = re.compile(rb"\x1b(?:\[[0-9;?]*)?\Z")  # an escape the chunk cut: its end comes with the next chunk
MAX_HELD_ESCAPE = 64
# steps:  45%|████▌     | 765/1700 [09:44<11:54,  1.31it/s, avr_loss=0.0871]   (one segment: no \r or \n in it)
BAR = re.compile(
    r"steps:\s*\d+%\|[^|\r\n]*\|\s*(\d+)/(\d+)\s*\[([\d:]+)<([\d:?]+),\s*([\d.?]+)(it/s|s/it)(?:,\s*([^\]\r\n]*))?\]"
)
LOSS = re.compile(r"avr_loss=([-+0-9.eE]+|nan|-?inf)")

# Phase markers and the lines that decide an outcome, in one alternation so a chunk is scanned once.
# The trainer's text is data: it echoes paths, captions and train ids, which anyone who writes a dataset
# chooses. So a marker counts only as a whole line that sd-scripts itself writes: it must begin the line's
# message (see LINE_PREFIX: after nothing but a glued tqdm redraw, indentation or a rich logger's time and
# level), and the fixed messages must also end it (END: nothing after them but a rich logger's `file.py:NN`).
# Exceptions count as their traceback's own `Type: message` line, never as text quoted inside another one.
END = r"(?=[ \t]*(?:[\w.-]+\.py:\d+[ \t]*)?(?:[\r\n]|\Z))"
MARKERS = re.compile(
    r"(?P<loading_model>loading model for process \d+/\d+" + END +
    r"|load StableDiffusion checkpoint: |load Diffusers pretrained models)"
    r"|(?P<caching_latents>caching latents(?:\.\.\.| with caching strategy\.)" + END + ")"
    r"|(?P<caching_text_encoder_outputs>caching Text Encoder outputs(?:\.\.\.| with caching strategy\.)" + END + ")"
    r"|(?P<preparing_training>import network module: )"
    r"|(?P<saving>saving checkpoint: (?P<checkpoint>[^\r\n]*))"
    r"|(?P<model_saved>model saved\." + END + ")"
    r"|(?P<total>total optimization steps[^:\r\n]*: (?P<total_steps>\d+)" + END + ")"
    r"|(?P<no_data>No data found\. Please verify arguments)"
    r"|(?P<cuda_oom>(?:torch\.(?:cuda\.)?OutOfMemoryError|RuntimeError): CUDA (?:out of memory|error: out of memory"
    r"|error: CUBLAS_STATUS_ALLOC_FAILED))"
    r"|(?P<caption_invalid>AssertionError: caption file is empty|illegal char in file \(not UTF-8\))"
    r"|(?P<model_load_error>ValueError: The provided pretrained_model_name_or_path \"[^\r\n]*\" is neither a valid local"
    r" path nor a valid repo id|ValueError: model is not found as a file or in Hugging Face"
    r"|(?:[\w.]+\.)?(?:HFValidationError|OfflineModeIsEnabled): )"
    r"|(?P<tokenizer_missing>(?:[\w.]+: )?We couldn't connect to 'https://huggingface\.co'"
    r"|TypeError: expected str, bytes or os\.PathLike object, not NoneType)"
    r"|(?P<invalid_arguments>[\w.-]+: error: (?:unrecognized arguments|argument ))"
    r"|(?P<died>subprocess\.CalledProcessError: Command [^\r\n]* died with <Signals\.SIG[A-Z0-9]+: (?P<signum>\d+)>\."
    + END + ")"
    r"|(?P<inner_exit>subprocess\.CalledProcessError: Command [^\r\n]* returned non-zero exit status"
    r" (?P<inner_rc>\d+)\." + END + ")"
)
# What may stand before a marker on its line: a tqdm redraw the next line was glued onto (the streams share one
# pipe, and a redraw ends in no newline), indentation, and a rich logger's `2026-11-30 03:36:26 INFO     `.
LINE_PREFIX = re.compile(
    r"(?:(?:[^\r\n|]{0,64}\d+%\|[^|\r\n]*\|[^\[\r\n]*|\d+it )\[[^\]\r\n]*\])?[ \t]*"
    r"(?:(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[ \t]+)?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[ \t]+)?"
)
# The same pattern without its named groups, to search with: each branch then starts with a literal that the
# regex engine rejects in one comparison (a branch that starts with a group is entered and left at every
# position), ~8x faster. A hit is matched again with MARKERS, at the same place, to name it.
MARKER_SEARCH = re.compile(re.sub(r"\(\?P<\w+>", "(?:", MARKERS.pattern))
PHASE_GROUPS = {p.value: p for p in (Phase.LOADING_MODEL, Phase.CACHING_LATENTS, Phase.CACHING_TEXT_ENCODER_OUTPUTS,
                                     Phase.PREPARING_TRAINING, Phase.SAVING)}
FLAG_GROUPS = ("model_saved", "no_data", "cuda_oom", "caption_invalid", "model_load_error", "tokenizer_missing",
               "invalid_arguments", "died", "inner_exit")
# Where a marker can begin a message, found over a run of log lines in a few C-level passes instead of a regex
# scan of every character (MARKER_SEARCH is ~0.1 µs a character): each branch of MARKERS begins, at the start of
# the message, with one of MESSAGE_STARTS, or holds one of INNER_LITERALS (the branches that begin with a
# name). A message begins a line, or follows a glued redraw's `]`, after LINE_PREFIX's spaces, time and level.
# A hit is a candidate only, parsed again with MARKERS and LINE_PREFIX, so these may find more, never less
# (tests/transcript/test_stream.py walks MARKERS to keep it so).
MESSAGE_STARTS = (
    "loading model for process ", "load StableDiffusion checkpoint: ", "load Diffusers pretrained models",
    "caching latents", "caching Text Encoder outputs", "import network module: ", "saving checkpoint: ",
    "model saved.", "total optimization steps", "No data found. Please verify arguments", "torch.",
    "RuntimeError: CUDA ", "AssertionError: caption file is empty", "illegal char in file (not UTF-8)",
    "ValueError: ", "TypeError: expected str", "subprocess.CalledProcessError: Command ",
)
INNER_LITERALS = (b"HFValidationError: ", b"OfflineModeIsEnabled: ", b"We couldn't connect to 'https://huggingface",
                  b": error: ")


def _message_pattern() -> bytes:
    """`[ \\t]*` and then a message start, bare or after a rich logger's time and level, as one alternation whose
    every branch begins with a different character: the engine tries one branch per character, without entering
    nested groups."""
    starts: dict[bytes, list[bytes]] = {}
    for literal in MESSAGE_STARTS:
        starts.setdefault(re.escape(literal[0].encode()), []).append(re.escape(literal[1:].encode()))
    message = b"(?:" + b"|".join(first + b"(?:" + b"|".join(rest) + b")" for first, rest in starts.items()) + b")"
    branches = [first + b"(?:" + b"|".join(rest) + b")" for first, rest in starts.items()]
    levels = (b"DEBUG", b"INFO", b"WARNING", b"ERROR", b"CRITICAL")  # none begins as a message start does
    branches += [level + rb"[ \t]+" + message for level in levels]
    branches.append(rb"\d\d\d\d-\d\d-\d\d \d\d:\d\d:\d\d[ \t]+(?:" + b"|".join(levels) + rb")[ \t]+" + message)
    # The characters the branches begin with, looked at first: most lines begin otherwise, and are rejected
    # with one class test instead of one test per branch.
    first = b"[" + b"".join(starts) + b"".join(level[:1] for level in levels) + rb"\d]"
    return rb"[ \t]*(?=" + first + rb")(?:" + b"|".join(branches) + b")"


_MESSAGE = _message_pattern()
AT_LINE_START = re.compile(_MESSAGE)
AFTER_NEWLINE = re.compile(rb"\n" + _MESSAGE)  # a literal first: the engine skips to each \n in C
AFTER_BAR = re.compile(rb"\]" + _MESSAGE)
# A short run of log lines (an epoch line between two runs of redraws) is looked at with one search for all of
# the above; a long one with a search each, each of which skips to its first character in C.
SMALL_RUN = 2048
SMALL_RUN_CANDIDATE = re.compile(AFTER_NEWLINE.pattern + b"|" + AFTER_BAR.pattern + b"|"
                                 + b"|".join(re.escape(literal) for literal in INNER_LITERALS))
MAX_PENDING = 64 * 1024  # a stream that never ends a segment must not grow without bound
# Every string MARKERS matches holds one of these characters, and a redraw of the `steps` bar none: a run of
# redraws without them cannot hold a marker (tests/transcript/test_parser.py walks MARKERS to keep this true). Looking
# for them is a memchr each.
MARKER_GUARD = "cdm"
MARKER_GUARD_BYTES = tuple(c.encode() for c in MARKER_GUARD)
STEPS = b"steps:"


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

    def enter(self, phase: Phase) -> None:
        if phase is not self.phase:
            self.phase = phase
            self.phases.append(phase)


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


class Parser:
    """Feed it the output (bytes, or text); it keeps `progress` current and collects each step's loss."""

    def __init__(self) -> None:
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
            self._open = (self._open + data)[-MAX_PENDING:]
        else:
            first = _first_break(data, cr, nl)
            self._segment(self._open + data[:first])  # the segment the last chunk left open ends here
            end = max(cr, nl) + 1
            self._region(data, first + 1, end)
            self._open = data[end:][-MAX_PENDING:]
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
        """One whole segment, on its own: its redraw, then its markers."""
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
                found += ((s, data.find(b"\n", s, start)) for s in _message_starts(data, pos, start))
            if cr < 0:
                break
            end = data.find(b"\n", cr, hi) + 1 or hi
            while (guard := min((at for g in MARKER_GUARD_BYTES if (at := data.find(g, start, end)) >= 0),
                                default=-1)) >= 0:
                found.append((_segment_start(data, guard, start), _segment_end(data, guard, end)))
                start = found[-1][1] + 1
            pos = end
        return found

    def _bars(self, data: bytes, lo: int, hi: int) -> None:
        """The `steps` redraws of data[lo:hi] (whole segments, none holding a marker): for each step, its newest
        redraw is applied, in order. They are found from the newest back, a step at a time (`_bar_before`), so a
        run of hundreds of redraws costs a few comparisons per step, not a parse of each redraw."""
        newest_first: list[re.Match[str]] = []
        found = self._newest_bar(data, lo, hi)
        while found is not None:
            at, m = found
            newest_first.append(m)
            found = self._bar_before(data, lo, at, m)
        for m in reversed(newest_first):
            self._apply(m)

    def _newest_bar(self, data: bytes, lo: int, hi: int) -> tuple[int, re.Match[str]] | None:
        """The newest `steps` redraw that parses in data[lo:hi], and where its segment starts."""
        end = hi
        while (at := data.rfind(STEPS, lo, end)) >= 0:
            end = at
            if (m := _bar_at(data, at, lo, hi)) is not None:
                return at, m
            # cut short, or not the bar: the one before it may be
        return None

    def _bar_before(self, data: bytes, lo: int, at: int, m: re.Match[str]) -> tuple[int, re.Match[str]] | None:
        """The newest redraw in data[lo:at] of a step before m's (the redraw whose segment starts at `at`).

        Every redraw of a step has the same bytes up to its counter (`steps:  45%|████▌     | 765/1700 [`), so
        whether a segment is of this step is one comparison at a known offset: a bisection over the run finds
        the step's first redraw in a few of them, without reading the redraws between."""
        if int(m[1]) == 0:
            return None
        text = m.string
        offset, counter = len(text[:m.start(1)].encode()), text[m.start(1):text.index("[", m.end(2)) + 1].encode()
        if data.startswith(counter, lo + offset):
            return None  # the whole run is of this step
        first, last = lo, at  # the segment at `first` is of another step, the one at `last` of this one
        while True:
            mid = (first + last) // 2
            cr = data.rfind(b"\r", first + 1, min(mid + 1, last - 1))
            if cr < 0 and (cr := data.find(b"\r", mid + 1, last - 1)) < 0:
                break  # no segment starts between them: `last` is the step's first redraw
            if data.startswith(counter, cr + 1 + offset):
                last = cr + 1
            else:
                first = cr + 1
        return self._newest_bar(data, lo, last)

    def _bar(self, text: str) -> None:
        m = BAR.match(text)
        if m is not None:
            self._apply(m)

    def _apply(self, m: re.Match[str]) -> None:
        # A redraw already applied while its segment was open is not applied again when the segment ends.
        if m[0] == self._last_bar:
            return
        self._last_bar = m[0]
        p = self.progress
        p.step, p.total_steps = int(m[1]), int(m[2])
        p.eta_s = _seconds(m[4])
        p.rate = _rate(m[5], m[6])
        loss = LOSS.search(m[7] or "")
        if loss:
            p.loss = float(loss[1])
            if p.nan_at is None and math.isnan(p.loss):
                p.nan_at = p.step
        if "model_saved" not in p.flags:
            # After a mid-run save the next redraw means training resumed.
            p.enter(Phase.TRAINING)
        if p.step > 0:
            self._points[p.step] = p.loss

    def _scan_markers(self, text: str) -> None:
        p = self.progress
        pos = 0
        while (hit := MARKER_SEARCH.search(text, pos)) is not None:
            start = hit.start()
            line_start = max(text.rfind("\n", 0, start), text.rfind("\r", 0, start)) + 1
            if not LINE_PREFIX.fullmatch(text, line_start, start):
                # Quoted inside another line (a path, a caption, an exception's message): data, not a marker.
                # Nothing later on this line can begin its message either.
                pos = _line_end(text, start)
                continue
            m = MARKERS.match(text, start)
            assert m is not None  # the same language: MARKER_SEARCH is MARKERS without names
            pos = _line_end(text, m.end())  # the rest of the line is the marker's argument, never another one
            kind = m.lastgroup
            if kind in PHASE_GROUPS:
                if "model_saved" not in p.flags:
                    p.enter(PHASE_GROUPS[kind])
                if kind == "saving":
                    p.checkpoints.append(m["checkpoint"].strip())
            elif kind == "total":
                p.total_steps = int(m["total_steps"])
            elif kind in FLAG_GROUPS:
                p.flags.add(kind)
                if kind == "model_saved":
                    # The final save is done. Under rich logging without PYTHONUNBUFFERED its `saving
                    # checkpoint:` print can reach the pipe after this line: the phase is `saving` either way.
                    p.enter(Phase.SAVING)
                elif kind == "died":
                    p.signal = int(m["signum"])
                elif kind == "inner_exit":
                    p.inner_exit = int(m["inner_rc"])

    def _snapshot(self) -> tuple[object, ...]:
        p = self.progress
        loss = None if p.loss is None or math.isnan(p.loss) else p.loss
        return (p.phase, p.step, p.total_steps, loss, p.loss is not None and math.isnan(p.loss), p.rate,
                p.eta_s, len(p.flags), len(p.checkpoints))


def _first_break(data: bytes, last_cr: int, last_nl: int) -> int:
    """Where the first segment of `data` ends (its first \r or \n), given that it has one."""
    cr = data.find(b"\r") if last_cr >= 0 else -1
    nl = data.find(b"\n", 0, cr if cr >= 0 else len(data)) if last_nl >= 0 else -1
    return nl if nl >= 0 else cr


def _message_starts(data: bytes, lo: int, hi: int) -> list[int]:
    """The starts of the log lines in data[lo:hi] (no \\r there, each ends in \\n) where a marker can begin
    the message, in order: a superset of where MARKERS can count, found with C-level searches."""
    if hi - lo <= SMALL_RUN and not AT_LINE_START.match(data, lo):
        if (first := SMALL_RUN_CANDIDATE.search(data, lo, hi)) is None:
            return []
        lo = _line_start(data, first.start(), lo)  # the lines before the first hit hold none
    starts: set[int] = set()
    if AT_LINE_START.match(data, lo):
        starts.add(lo)
    for pattern in (AFTER_NEWLINE, AFTER_BAR):
        starts.update(_line_start(data, m.start(), lo) for m in pattern.finditer(data, lo, hi))
    for literal in INNER_LITERALS:
        at = data.find(literal, lo, hi)
        while at >= 0:
            starts.add(_line_start(data, at, lo))
            at = data.find(literal, data.find(b"\n", at, hi), hi)
    return sorted(s for s in starts if s < hi)


def _bar_at(data: bytes, at: int, lo: int, hi: int) -> re.Match[str] | None:
    """The `steps` redraw whose segment starts at `at`, parsed, or None."""
    if at > lo and data[at - 1] not in (10, 13):
        return None  # "validation steps:", or text that mentions steps: not the training bar
    return BAR.match(data[at:_segment_end(data, at, hi)].decode("utf-8", "replace"))


def _segment_start(data: bytes, pos: int, lo: int) -> int:
    return max(data.rfind(b"\r", lo, pos), data.rfind(b"\n", lo, pos)) + 1 or lo


def _segment_end(data: bytes, pos: int, hi: int) -> int:
    """Where the segment holding `pos` ends (its \r or \n), or `hi`."""
    cr = data.find(b"\r", pos, hi)  # in a run of redraws the next \r is near, the next \n may be far
    nl = data.find(b"\n", pos, cr if cr >= 0 else hi)
    return nl if nl >= 0 else cr if cr >= 0 else hi


def _line_start(data: bytes, pos: int, lo: int) -> int:
    """The start of the line holding `pos`, or of the line after it when `pos` is a line's \n."""
    if data[pos] == 10:
        return pos + 1
    return data.rfind(b"\n", lo, pos) + 1 or lo


def _line_end(text: str, pos: int) -> int:
    """Where the line (or the redraw segment) holding `pos` ends."""
    ends = [e for e in (text.find("\n", pos), text.find("\r", pos)) if e >= 0]
    return min(ends) if ends else len(text)


def _seconds(clock: str) -> float | None:
    if "?" in clock:
        return None
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return float(total)


def _rate(value: str, unit: str) -> float | None:
    if "?" in value:
        return None
    number = float(value)
    if unit == "s/it":
        return 1.0 / number if number > 0 else None
    return number

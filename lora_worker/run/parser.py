"""Incremental, pure parser of sd-scripts output: phase, step/total, avr_loss, rate, ETA, and failure markers.

The trainer's progress is tqdm's `steps` bar on stderr, redrawn with `\\r` even off a TTY; log lines arrive on
stdout with --console_log_simple. Both come through one pipe, in the order they were written. Chunks are cut
anywhere, a log line may be glued onto a redraw, and a redraw may end in pad spaces. So the text is split on
`\\r` and `\\n`. A marker (a phase, `model saved.`, a failure) counts only where it begins a line's message
(MARKERS, LINE_PREFIX): the trainer echoes paths and captions.

Cost: the parser works on whole chunks with C-level scans (a marker search over the complete text, skipped when
it cannot hold one; one `rfind` + `match` for the newest redraw), never a Python loop per redraw; the Decoder
drops the redraws a chunk overwrites before decoding, so a flood is neither decoded nor scanned redraw by redraw
(bench/stream.py measures it). Per-step losses are sampled at chunk granularity; real steps are seconds apart.
"""
from __future__ import annotations

import codecs
import math
import re
from dataclasses import dataclass, field

from lora_worker.states import Phase

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# steps:  45%|████▌     | 765/1700 [09:44<11:54,  1.31it/s, avr_loss=0.0871]
BAR = re.compile(
    r"steps:\s*\d+%\|[^|]*\|\s*(\d+)/(\d+)\s*\[([\d:]+)<([\d:?]+),\s*([\d.?]+)(it/s|s/it)(?:,\s*([^\]]*))?\]"
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
MAX_PENDING = 64 * 1024  # a stream that never ends a line must not grow without bound
# Every string MARKERS matches holds one of these characters, and a redraw of the `steps` bar none: text
# without them cannot hold a marker (tests/test_parser.py walks MARKERS to keep this true). Checking them is a
# memchr each; even MARKER_SEARCH costs ~0.1 µs per character, a lot on a bar redrawn ten times a second.
MARKER_GUARD = "cdmU"
MARKER_GUARD_BYTES = tuple(c.encode() for c in MARKER_GUARD)
STEPS_REDRAW = b"\rsteps:"


@dataclass
class Progress:
    """What the trainer has told us so far."""

    phase: Phase = Phase.LAUNCHING
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    rate: float | None = None  # optimizer steps per second
    eta_s: float | None = None  # tqdm's remaining time (average since start, warm-up included)
    flags: set[str] = field(default_factory=set)  # marker names seen: model_saved, cuda_oom, …
    signal: int | None = None  # from the launcher's "died with <Signals.SIGKILL: 9>"
    inner_exit: int | None = None  # the trainer's own exit status, from the launcher's message
    checkpoints: list[str] = field(default_factory=list)


class Decoder:
    """Bytes to text: UTF-8 kept whole across chunk cuts, bad bytes replaced, ANSI removed, and redraws that a
    later redraw in the same chunk overwrites left out (see `drop_superseded_redraws`)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def decode(self, data: bytes, final: bool = False) -> str:
        text = self._decoder.decode(drop_superseded_redraws_by_line(data), final)
        return ANSI.sub("", text) if "\x1b" in text else text

    def reset(self) -> None:
        """Forget a partial character held back: the text it belonged to was overwritten."""
        self._decoder.reset()


def drop_superseded_redraws(data: bytes) -> bytes:
    """`data` less the `steps` redraws that a later one in the same chunk overwrites on the same line.

    Whoever reads the text keeps only the newest redraw of a line: the parser the newest bar (or the one before,
    if the newest is cut short), the run log and the error tail the line's last segment. So from the chunk's
    first `\\r` to its second-newest `steps` redraw nothing is needed, provided that stretch ends no line and
    holds no marker. A flooding trainer's 64 KiB chunk, ~700 redraws, then costs a few memchr passes instead
    of a decode and a regex scan of all of it (bench/stream.py). Cuts fall on `\\r`, which is never inside a
    UTF-8 sequence, so decoding the rest gives exactly the text it gave before.
    """
    first = data.find(b"\r")
    if first < 0:
        return data
    newest = data.rfind(STEPS_REDRAW, first)
    keep = data.rfind(STEPS_REDRAW, first, newest) if newest > first else -1
    if keep <= first or data.find(b"\n", first, keep) >= 0:
        return data
    if any(data.find(guard, first, keep) >= 0 for guard in MARKER_GUARD_BYTES):
        return data
    return data[:first] + data[keep:]


def drop_superseded_redraws_by_line(data: bytes) -> bytes:
    """`drop_superseded_redraws` on each line of `data`: a chunk of the merged output stream holds log lines
    between its runs of redraws, and each run is overwritten within its own line."""
    if b"\n" not in data:
        return drop_superseded_redraws(data)
    return b"\n".join(drop_superseded_redraws(line) if b"\r" in line else line for line in data.split(b"\n"))


class Parser:
    """Feed it decoded text; it keeps `progress` current and collects per-step losses."""

    def __init__(self) -> None:
        self.progress = Progress()
        self._pending = ""
        self._last_bar = ""
        self._points: dict[int, float | None] = {}

    def feed(self, text: str) -> bool:
        """Parse a chunk; True if the progress changed."""
        buffered = self._pending + text
        cut = max(buffered.rfind("\n"), buffered.rfind("\r"))
        complete = buffered[: cut + 1]
        self._pending = buffered[cut + 1:][-MAX_PENDING:]
        before = self._snapshot()
        marker_at = self._scan_markers(complete) if any(c in complete for c in MARKER_GUARD) else -1
        # The newest redraw may be the unterminated tail; it is whole once it ends in "]".
        self._scan_bar(buffered, after=marker_at)
        return self._snapshot() != before

    def close(self) -> bool:
        """End of output: whatever was left without a line end is parsed as a last line."""
        return self.feed("\n") if self._pending else False

    def take_points(self) -> list[tuple[int, float | None]]:
        """The (step, loss) pairs seen since the last call."""
        points, self._points = sorted(self._points.items()), {}
        return points

    def _scan_markers(self, text: str) -> int:
        last_phase_at = -1
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
                    p.phase = PHASE_GROUPS[kind]
                    last_phase_at = start
                if kind == "saving":
                    p.checkpoints.append(m["checkpoint"].strip())
            elif kind == "total":
                p.total_steps = int(m["total_steps"])
            elif kind in FLAG_GROUPS:
                p.flags.add(kind)
                if kind == "model_saved":
                    # The final save is done. Under rich logging without PYTHONUNBUFFERED its `saving
                    # checkpoint:` print can reach the pipe after this line: the phase is `saving` either way.
                    p.phase = Phase.SAVING
                    last_phase_at = start
                elif kind == "died":
                    p.signal = int(m["signum"])
                elif kind == "inner_exit":
                    p.inner_exit = int(m["inner_rc"])
        return last_phase_at

    def _scan_bar(self, text: str, after: int) -> None:
        pos = len(text)
        for _ in range(4):  # the newest redraw, or the one before it if the newest is still cut short
            pos = text.rfind("steps:", 0, pos)
            if pos < 0:
                return
            if pos > 0 and text[pos - 1] not in "\r\n":
                continue  # "validation steps:" or text mentioning steps: not the training bar
            m = BAR.match(text, pos)
            if m:
                # A redraw left pending from the last chunk was applied then; applying it again could
                # undo a phase change reported since.
                if m[0] != self._last_bar:
                    self._last_bar = m[0]
                    self._apply_bar(m, newer_than_marker=pos > after)
                return

    def _apply_bar(self, m: re.Match[str], newer_than_marker: bool) -> None:
        p = self.progress
        p.step, p.total_steps = int(m[1]), int(m[2])
        p.eta_s = _seconds(m[4])
        p.rate = _rate(m[5], m[6])
        loss = LOSS.search(m[7] or "")
        if loss:
            p.loss = float(loss[1])
        if newer_than_marker and "model_saved" not in p.flags:
            # After a mid-run save the next redraw means training resumed.
            p.phase = Phase.TRAINING
        if p.step > 0:
            self._points[p.step] = p.loss

    def _snapshot(self) -> tuple[object, ...]:
        p = self.progress
        loss = None if p.loss is None or math.isnan(p.loss) else p.loss
        return (p.phase, p.step, p.total_steps, loss, p.loss is not None and math.isnan(p.loss), p.rate,
                p.eta_s, len(p.flags), len(p.checkpoints))


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

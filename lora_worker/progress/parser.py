"""Incremental, pure parser of sd-scripts output: phase, step/total, avr_loss, rate, ETA, and failure markers.

The trainer's progress is tqdm's `steps` bar on stderr, redrawn with `\\r` even off a TTY; log lines arrive on
stdout with --console_log_simple. Chunks are cut anywhere, a log line may be glued onto a redraw, and a redraw
may end in pad spaces. So each stream is split on `\\r` and `\\n`, and matching is by `search`, never anchored.

Cost: the parser works on whole chunks with C-level scans (one marker `finditer` over the complete text, one
`rfind` + `match` for the newest redraw), never a Python loop per redraw, so a 100 MB stream costs little more
than reading it. Per-step losses are sampled at chunk granularity; real steps are seconds apart.
"""
from __future__ import annotations

import codecs
import math
import re
from dataclasses import dataclass, field

from lora_worker.ledger.states import Phase

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# steps:  45%|████▌     | 765/1700 [09:44<11:54,  1.31it/s, avr_loss=0.0871]
BAR = re.compile(
    r"steps:\s*\d+%\|[^|]*\|\s*(\d+)/(\d+)\s*\[([\d:]+)<([\d:?]+),\s*([\d.?]+)(it/s|s/it)(?:,\s*([^\]]*))?\]"
)
LOSS = re.compile(r"avr_loss=([-+0-9.eE]+|nan|-?inf)")

# Phase markers and the lines that decide an outcome, in one alternation so a chunk is scanned once.
MARKERS = re.compile(
    r"(?P<loading_model>loading model for process|load StableDiffusion checkpoint|load Diffusers pretrained models)"
    r"|(?P<caching_latents>caching latents)"
    r"|(?P<caching_text_encoder_outputs>caching Text Encoder outputs)"
    r"|(?P<preparing_training>import network module)"
    r"|(?P<saving>saving checkpoint: (?P<checkpoint>[^\r\n]*))"
    r"|(?P<model_saved>model saved\.)"
    r"|(?P<total>total optimization steps[^:\r\n]*: (?P<total_steps>\d+))"
    r"|(?P<no_data>No data found\. Please verify arguments)"
    r"|(?P<cuda_oom>CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED)"
    r"|(?P<caption_invalid>caption file is empty|illegal char in file \(not UTF-8\))"
    r"|(?P<model_load_error>is neither a valid local path nor a valid repo id"
    r"|model is not found as a file or in Hugging Face|HFValidationError|OfflineModeIsEnabled)"
    r"|(?P<tokenizer_missing>couldn't connect to 'https://huggingface\.co'"
    r"|expected str, bytes or os\.PathLike object, not NoneType)"
    r"|(?P<invalid_arguments>error: unrecognized arguments|error: argument )"
    r"|(?P<died>died with <Signals\.SIG[A-Z0-9]+: (?P<signum>\d+)>)"
    r"|(?P<inner_exit>returned non-zero exit status (?P<inner_rc>\d+))"
)
PHASE_GROUPS = {p.value: p for p in (Phase.LOADING_MODEL, Phase.CACHING_LATENTS, Phase.CACHING_TEXT_ENCODER_OUTPUTS,
                                     Phase.PREPARING_TRAINING, Phase.SAVING)}
FLAG_GROUPS = ("model_saved", "no_data", "cuda_oom", "caption_invalid", "model_load_error", "tokenizer_missing",
               "invalid_arguments", "died", "inner_exit")
MAX_PENDING = 64 * 1024  # a stream that never ends a line must not grow without bound


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
    """Bytes to text per stream: UTF-8 kept whole across chunk cuts, bad bytes replaced, ANSI removed."""

    def __init__(self) -> None:
        self._decoders: dict[str, codecs.IncrementalDecoder] = {}

    def decode(self, stream: str, data: bytes, final: bool = False) -> str:
        decoder = self._decoders.setdefault(stream, codecs.getincrementaldecoder("utf-8")("replace"))
        text = decoder.decode(data, final)
        return ANSI.sub("", text) if "\x1b" in text else text


class Parser:
    """Feed it decoded text per stream; it keeps `progress` current and collects per-step losses."""

    def __init__(self) -> None:
        self.progress = Progress()
        self._pending: dict[str, str] = {}
        self._last_bar: dict[str, str] = {}
        self._points: dict[int, float | None] = {}

    def feed(self, stream: str, text: str) -> bool:
        """Parse a chunk; True if the progress changed."""
        buffered = self._pending.get(stream, "") + text
        cut = max(buffered.rfind("\n"), buffered.rfind("\r"))
        complete = buffered[: cut + 1]
        self._pending[stream] = buffered[cut + 1:][-MAX_PENDING:]
        before = self._snapshot()
        marker_at = self._scan_markers(complete) if complete else -1
        # The newest redraw may be the unterminated tail; it is whole once it ends in "]".
        self._scan_bar(stream, buffered, after=marker_at)
        return self._snapshot() != before

    def close(self) -> bool:
        """End of output: whatever was left without a line end is parsed as a last line."""
        changed = False
        for stream in list(self._pending):
            if self._pending[stream]:
                changed |= self.feed(stream, "\n")
        return changed

    def take_points(self) -> list[tuple[int, float | None]]:
        """The (step, loss) pairs seen since the last call."""
        points, self._points = sorted(self._points.items()), {}
        return points

    def _scan_markers(self, text: str) -> int:
        last_phase_at = -1
        p = self.progress
        for m in MARKERS.finditer(text):
            kind = m.lastgroup
            if kind in PHASE_GROUPS and "model_saved" not in p.flags:
                p.phase = PHASE_GROUPS[kind]
                last_phase_at = m.start()
                if kind == "saving":
                    p.checkpoints.append(m["checkpoint"].strip())
            elif kind == "total":
                p.total_steps = int(m["total_steps"])
            elif kind in FLAG_GROUPS:
                p.flags.add(kind)
                if kind == "died":
                    p.signal = int(m["signum"])
                elif kind == "inner_exit":
                    p.inner_exit = int(m["inner_rc"])
        return last_phase_at

    def _scan_bar(self, stream: str, text: str, after: int) -> None:
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
                # undo a phase change that another stream reported since.
                if m[0] != self._last_bar.get(stream):
                    self._last_bar[stream] = m[0]
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

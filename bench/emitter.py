"""A stand-in trainer for the benchmarks: the real capture's output, with its training bar redrawn N times.

Run as a job's argv (stdlib only: the supervisor gives a trainer an allow-listed environment and no path).
It replays tests/data/run1_simple.jsonl byte for byte up to the training bar (every phase line the parser
looks for), then draws the `steps` bar the way tqdm does (two `\\r` redraws per optimizer step, the second
with the new `avr_loss`; an `epoch N/M` line on stdout every epoch), then replays the capture's end
(`saving checkpoint: …`, `model saved.`, the bar's close).

All output is rendered before the first byte is written, so writing costs the emitter almost nothing and
the reader, not the emitter, sets the pace:
  --bytes N        redraw until the body holds N bytes, written as fast as the pipe takes it, in writes of
                   --write-size bytes (64 KiB: a full pipe), so every reader sees the same full chunks;
  --rate R         write each redraw alone (as tqdm does) at R redraws a second, on an absolute schedule;
  --lines          with --bytes: the body is log lines instead of redraws, each ending in `\\n` (the capture's
                   own lines before the training bar, those that are no phase line, over and over): a chatty
                   trainer, whose every line is parsed, logged and kept for the error tail.
--go FILE: write FILE.ready (our pid) once rendered, and start only when FILE exists, so the bench can read the
reader's CPU time at the first byte.
"""
from __future__ import annotations

import argparse
import base64
import functools
import json
import os
import sys
import time

BAR_WIDTH = 10  # tqdm's bar at COLUMNS=250 with a `steps` description, as in the capture
BLOCKS = " ▏▎▍▌▋▊▉█"


def load_capture(path: str) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
    """The capture's chunks before the training bar's first redraw, and from `saving checkpoint` on."""
    with open(path, encoding="utf-8") as fh:
        chunks = [json.loads(line) for line in fh][1:]
    events = [(1 if c["stream"] == "stdout" else 2, base64.b64decode(c["b64"])) for c in chunks]
    first_bar = next(i for i, (_, data) in enumerate(events) if data.startswith(b"\rsteps:"))
    saving = next(i for i, (_, data) in enumerate(events) if b"saving checkpoint:" in data)
    return events[:first_bar], events[saving:]


@functools.cache  # a flood redraws each step hundreds of times; render each once
def bar(step: int, total: int, loss: float | None) -> bytes:
    """One redraw of the `steps` bar, as tqdm 4.70 draws it (see the capture)."""
    frac = step / total
    filled = frac * BAR_WIDTH
    full = int(filled)
    part = BLOCKS[int((filled - full) * 8)] if full < BAR_WIDTH else ""
    body = ("█" * full + part).ljust(BAR_WIDTH)
    if step == 0:  # tqdm knows no rate before the first step
        return f"\rsteps:   0%|{body}| 0/{total} [00:00<?, ?it/s]".encode()
    elapsed = int(step * 3.7)
    left = int((total - step) * 3.7)
    postfix = f", avr_loss={loss:.3g}" if loss is not None else ""
    return (f"\rsteps: {int(frac * 100):3d}%|{body}| {step}/{total} [{_clock(elapsed)}<{_clock(left)},"
            f"  3.70s/it{postfix}]").encode()


# The capture's lines that name a phase or an outcome: a flood of log lines repeats the others, so the job's
# phase stays put (each phase change is a ledger write, which is not what the flood measures).
PHASE_LINES = (b"loading model for process", b"load StableDiffusion", b"caching latents", b"caching Text Encoder",
               b"import network module", b"total optimization steps", b"model saved.", b"saving checkpoint:")


def log_lines(head: list[tuple[int, bytes]]) -> list[bytes]:
    """The `\\n`-terminated log lines of the capture's head that are no redraw and name no phase."""
    text = b"".join(data for fd, data in head if fd == 1)
    lines = [line + b"\n" for line in text.split(b"\n")[:-1]]
    return [line for line in lines if line.strip() and not any(p in line for p in PHASE_LINES)]


def line_body(lines: list[bytes], max_bytes: int) -> list[tuple[int, bytes]]:
    """Log lines on stdout, over and over, until they hold `max_bytes`."""
    events, size, i = [], 0, 0
    while size < max_bytes:
        events.append((1, lines[i % len(lines)]))
        size += len(events[-1][1])
        i += 1
    return events


def _clock(seconds: int) -> str:
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def body(total_steps: int, redraws: int | None, max_bytes: int | None, epoch_steps: int) -> list[tuple[int, bytes]]:
    """The training part: two redraws per step (the step, then its new loss), an epoch line every epoch."""
    events: list[tuple[int, bytes]] = [(2, bar(0, total_steps, None))]
    steps_in_body = max(1, (redraws if redraws is not None else (max_bytes or 0) // 90) // 2)
    epochs = -(-total_steps // epoch_steps)
    size, i, loss = 0, 0, None
    while (redraws is None or i < redraws) and (max_bytes is None or size < max_bytes):
        k = i // 2  # the body's step; shown scaled so the bar moves once from 1 to total_steps
        if i % 2 == 0 and k % epoch_steps == 0:
            epoch = min(epochs, k // epoch_steps + 1)
            line = f"\nepoch {epoch}/{epochs}\n\nepoch is incremented. current_epoch: {epoch - 1}, epoch: {epoch}\n"
            events.append((1, line.encode()))
            size += len(events[-1][1])
        step = min(total_steps, 1 + k * total_steps // steps_in_body)
        if i % 2:  # tqdm's second redraw of a step carries the step's new average loss
            loss = 0.05 + 0.1 * ((step * 7919) % 97) / 97
        data = bar(step, total_steps, loss)
        events.append((2, data))
        size += len(data)
        i += 1
    return events


def coalesce(events: list[tuple[int, bytes]], write_size: int) -> list[tuple[int, bytes]]:
    """Merge neighbouring writes to the same stream into writes of about `write_size` bytes."""
    merged: list[tuple[int, bytes]] = []
    fd_now, parts, size = 0, [], 0
    for fd, data in events:
        if parts and (fd != fd_now or size >= write_size):
            merged.append((fd_now, b"".join(parts)))
            parts, size = [], 0
        fd_now = fd
        parts.append(data)
        size += len(data)
    if parts:
        merged.append((fd_now, b"".join(parts)))
    return merged


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def wait_for_go(go: str) -> None:
    with open(go + ".ready.tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(go + ".ready.tmp", go + ".ready")
    while not os.path.exists(go):
        time.sleep(0.005)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--capture", required=True)
    parser.add_argument("--total-steps", type=int, default=3000)
    parser.add_argument("--epoch-steps", type=int, default=150)
    parser.add_argument("--bytes", type=int)
    parser.add_argument("--redraws", type=int)
    parser.add_argument("--rate", type=float, help="redraws a second; without it, as fast as the pipe takes it")
    parser.add_argument("--lines", action="store_true", help="with --bytes: log lines instead of redraws")
    parser.add_argument("--write-size", type=int, default=1 << 16)
    parser.add_argument("--go")
    args = parser.parse_args(argv)
    head, tail = load_capture(args.capture)
    if args.lines:
        middle = line_body(log_lines(head), args.bytes or 0)
    else:
        middle = body(args.total_steps, args.redraws, args.bytes, args.epoch_steps)
    if args.rate is None:
        middle = coalesce(middle, args.write_size)
    if args.go:
        wait_for_go(args.go)
    for fd, data in head:
        write_all(fd, data)
    start = time.monotonic()
    redraw = 0
    for fd, data in middle:
        if args.rate is not None and fd == 2:
            delay = start + redraw / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            redraw += 1
        write_all(fd, data)
    for fd, data in tail:
        write_all(fd, data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

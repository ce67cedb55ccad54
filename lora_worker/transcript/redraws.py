"""The redraws of tqdm's `steps` bar: one parsed (step/total, ETA, rate, avr_loss), and, in a run of hundreds
of them, the newest of each step found in a few comparisons (`newest_bar`, `bar_before`).

A redraw ends in `\\r`, never a newline, and holds none of MARKER_GUARD's characters (transcript/markers.py).
"""
from __future__ import annotations

import math
import re

# steps:  45%|████▌     | 765/1700 [09:44<11:54,  1.31it/s, avr_loss=0.0871]   (one segment: no \r or \n in it)
BAR = re.compile(
    r"steps:\s*\d+%\|[^|\r\n]*\|\s*(\d+)/(\d+)\s*\[([\d:]+)<([\d:?]+),\s*([\d.?]+)(it/s|s/it)(?:,\s*([^\]\r\n]*))?\]"
)
LOSS = re.compile(r"avr_loss=([-+0-9.eE]+|nan|-?inf)")
STEPS = b"steps:"
MAX_COUNT = 10**9  # far past any run's steps, and well inside a ledger INTEGER
MAX_SEGMENT = 64 * 1024  # of a longer segment only its head is read (transcript/parser.py MAX_PENDING)


def newest_bar(data: bytes, lo: int, hi: int) -> tuple[int, re.Match[str]] | None:
    """The newest `steps` redraw that parses in data[lo:hi], and where its segment starts."""
    end = hi
    while (at := data.rfind(STEPS, lo, end)) >= 0:
        end = at
        if (m := bar_at(data, at, lo, hi)) is not None:
            return at, m
        # cut short, or not the bar: the one before it may be
    return None


def bar_before(data: bytes, lo: int, at: int, m: re.Match[str]) -> tuple[int, re.Match[str]] | None:
    """The newest redraw in data[lo:at] of a step before m's (the redraw whose segment starts at `at`).

    Every redraw of a step has the same bytes up to its counter (`steps:  45%|████▌     | 765/1700 [`), so
    whether a segment is of this step is one comparison at a known offset: a bisection over the run finds
    the step's first redraw in a few of them, without reading the redraws between."""
    if not m[1].strip("0"):  # step 0: no step before it (no int() of what may be thousands of digits)
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
    return newest_bar(data, lo, last)


def bar_at(data: bytes, at: int, lo: int, hi: int) -> re.Match[str] | None:
    """The `steps` redraw whose segment starts at `at`, parsed, or None."""
    if at > lo and data[at - 1] not in (10, 13):
        return None  # "validation steps:", or text that mentions steps: not the training bar
    m = BAR.match(data[at:min(segment_end(data, at, hi), at + MAX_SEGMENT)].decode("utf-8", "replace"))
    # a counter that is no number is no bar: the redraw before it is the newest (as when each is read on its own)
    return m if m is not None and counts(m) is not None else None


def counts(m: re.Match[str]) -> tuple[int, int] | None:
    """A redraw's step and total, or None when they are no counter a bar shows: not ASCII digits, or past
    MAX_COUNT. A step past its total is taken as it is: tqdm draws one when updated past its total, and a redraw
    left out would starve the stall watchdog, which counts only new steps as life in training."""
    step, total = count(m[1]), count(m[2])
    return (step, total) if step is not None and total is not None else None



def segment_end(data: bytes, pos: int, hi: int) -> int:
    """Where the segment holding `pos` ends (its \r or \n), or `hi`."""
    cr = data.find(b"\r", pos, hi)  # in a run of redraws the next \r is near, the next \n may be far
    nl = data.find(b"\n", pos, cr if cr >= 0 else hi)
    return nl if nl >= 0 else cr if cr >= 0 else hi



def count(text: str | None, limit: int = MAX_COUNT) -> int | None:
    """A counter the trainer printed (a step, a total, a signal number), or None when it is not one: ASCII digits
    only (`\\d` also matches other scripts' digits), at most `limit`. Whatever a line holds, a number taken from it
    is one a ledger column holds."""
    if text is None or len(text) > len(str(limit)) or not text.isdigit() or not text.isascii():
        return None
    value = int(text)
    return value if value <= limit else None


CLOCK = re.compile(r"(?:([0-9]{1,9}):)?([0-9]{1,9}):([0-9]{1,9})")  # tqdm's format_interval: [H:]MM:SS


def seconds(clock: str) -> float | None:
    """tqdm's `MM:SS` or `H:MM:SS`, in seconds; None for `?` or anything else."""
    m = CLOCK.fullmatch(clock)
    if m is None:
        return None
    return float((int(m[1] or 0) * 60 + int(m[2])) * 60 + int(m[3]))


def rate(value: str, unit: str) -> float | None:
    """Optimizer steps per second from tqdm's `1.31it/s` or `2.50s/it`; None for `?`, or anything that is not a
    finite number above 0."""
    try:
        number = float(value)
    except ValueError:  # `?`, `1.2.3`, `.`
        return None
    if not (math.isfinite(number) and number > 0):
        return None
    steps = 1.0 / number if unit == "s/it" else number
    return steps if steps > 0 else None


def loss(text: str | None) -> float | None:
    """The `avr_loss=` of a redraw's postfix: a float (NaN and infinities included, as the trainer printed them),
    or None when there is none or it does not parse."""
    found = LOSS.search(text or "")
    if found is None:
        return None
    try:
        return float(found[1])
    except ValueError:  # `e`, `1.2.3`, `+-`
        return None

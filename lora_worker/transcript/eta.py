"""Honest time left: the seconds a user will still wait, counted down as they watch.

tqdm's ETA divides by the average rate since the bar opened, warm-up included, and stops at the last step;
the user waits on past it, while the LoRA is saved, the trainer tears down and the worker verifies the file.
So `eta_s` here is

- before the first step: the history estimate (median wall time of similar finished jobs) minus the time
  spent, basis "history";
- from the first step on: the steps left at the newest step times the measured time per step (the first
  step's own duration at step 1, then the recent window, which leaves that warm-up step out), plus the tail
  (save + teardown, learned from finished jobs of the same tier and device), minus the time since that step,
  basis "measured". It counts down between steps and never promises less than the tail while steps remain.
- with sample passes (issue 33): a pass blocks training, and its bar is no step. So the time of each pass is
  measured (from `sampling` to the next phase) and taken off the steps' clock, and the passes left (one at each
  multiple of the interval after the newest step) count at the median cost of those measured, the one under way
  at what is left of it. The pass before the first step measures the first cost; a resume has none until its own.

Pure: every method takes the time it is asked at (`time.monotonic()` in the supervisor, a capture's
timestamps in a replay), so a test drives it with a fake clock.
"""
from __future__ import annotations

import statistics
from collections import deque

from lora_worker.states import Phase

WINDOW_STEPS = 50  # long enough to smooth step jitter, short enough to follow a change of pace
WINDOW_S = 120.0
# Save + teardown until a finished job of the same tier and device has measured it: a guess, about twice the
# 4.3 s of the CPU captures (a 43 MB LoRA, a 20 GB process to tear down), since a GPU run also frees the card and
# saves a larger file. The first finished job replaces it with a measurement.
DEFAULT_TAIL_S = 10.0
MEASURED_PHASES = (Phase.TRAINING, Phase.SAMPLING, Phase.SAVING)


def estimate_duration(history: list[float]) -> float | None:
    """The expected wall time of a job from the durations of similar finished jobs; None without history."""
    return statistics.median(history) if history else None


def estimate_resume(*, pre_training_s: float | None, rate: float | None, steps_left: int,
                    whole_s: float | None) -> float | None:
    """A resume's expected wall time: the pre-training phase (launch, model load, caching) is redone in full,
    then only the steps left, at the pace the original measured, then the tail. Without the original's
    measurements, the whole job's history estimate (more than a resume takes: it also trains the done steps)."""
    if pre_training_s is not None and rate:
        return pre_training_s + steps_left / rate + DEFAULT_TAIL_S
    return whole_s


def estimate_tail(history: list[float]) -> float:
    """The expected save + teardown after the last step: the median of finished jobs, or DEFAULT_TAIL_S."""
    return statistics.median(history) if history else DEFAULT_TAIL_S


class EtaClock:
    """Turns (step, time) observations into a rate and the time left, with the basis it rests on."""

    def __init__(self, total_steps: int, estimated_duration_s: float | None,
                 tail_s: float = DEFAULT_TAIL_S, first_step: int = 0, sample_every: int = 0) -> None:
        self.total_steps = total_steps
        self.first_step = first_step  # a resume's: its bar opens there, and steps before it took no time here
        self.estimate = estimated_duration_s
        self.tail_s = tail_s
        self._opened_at: float | None = None  # when the steps bar showed 0/N: the first step starts there
        self._seen: deque[tuple[float, int]] = deque()  # (the steps' clock, step)
        self.sample_every = sample_every  # the steps between sample passes; 0: none
        self.passes_s: list[float] = []  # each finished pass's duration
        self._pass_at: float | None = None  # when the pass under way began
        self._paused_s = 0.0  # the finished passes' time, off the steps' clock

    def follow(self, phase: Phase, step: int, now: float) -> None:
        """Take in the progress after each piece of output: when training started, each new step, and the
        sample passes begun and ended."""
        if phase is Phase.SAMPLING and self._pass_at is None:
            self._pass_at = now
        elif phase is not Phase.SAMPLING and self._pass_at is not None:
            self.passes_s.append(now - self._pass_at)
            self._paused_s += now - self._pass_at
            self._pass_at = None
        if phase is Phase.TRAINING and step == self.first_step and self._opened_at is None and not self._seen:
            self._opened_at = self._clock(now)
        self.observe(step, now)

    def _clock(self, now: float) -> float:
        """The steps' clock: the time at `now` less every pass's."""
        return now - self._paused_s - (now - self._pass_at if self._pass_at is not None else 0.0)

    def _passes_left(self, step: int, now: float) -> float:
        """The seconds the sample passes after `step` will take, the one under way included."""
        if not self.sample_every or not self.passes_s:
            return 0.0
        cost = statistics.median(self.passes_s)
        left = (self.total_steps // self.sample_every - step // self.sample_every) * cost
        return left + (max(0.0, cost - (now - self._pass_at)) if self._pass_at is not None else 0.0)

    def observe(self, step: int, now: float) -> None:
        """Record that `step` was reached at `now` (a step seen again, or an older one, changes nothing)."""
        if step <= self.first_step or (self._seen and self._seen[-1][1] >= step):
            return
        now = self._clock(now)
        self._seen.append((now, step))
        while len(self._seen) > WINDOW_STEPS + 1 or (len(self._seen) > 2 and now - self._seen[0][0] > WINDOW_S):
            self._seen.popleft()

    def rate(self) -> float | None:
        """Optimizer steps per second: over the recent window once two steps are seen (the first step, the
        slowest by far, left out), the first step's own pace before that; None until then."""
        if len(self._seen) >= 2:
            (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
            return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None
        if self._seen and self._opened_at is not None:
            t1, s1 = self._seen[0]
            done = s1 - self.first_step
            return done / (t1 - self._opened_at) if t1 > self._opened_at else None
        return None

    def eta(self, phase: Phase, now: float, elapsed_s: float) -> tuple[float | None, str | None]:
        """(seconds left, basis) at `now`, `elapsed_s` after the job started: "measured" once a step rate
        exists, "history" before, (None, None) with neither."""
        rate = self.rate() if phase in MEASURED_PHASES else None
        if rate:
            at, step = self._seen[-1]
            steps_left = max(0, self.total_steps - step)
            left_at_step = steps_left / rate + self.tail_s
            floor = self.tail_s if steps_left else 0.0  # the save is still to come while steps remain
            return max(floor, left_at_step - (self._clock(now) - at)) + self._passes_left(step, now), "measured"
        if self.estimate is not None:
            return max(self.tail_s, self.estimate - elapsed_s), "history"
        return None, None

    def moves(self) -> bool:
        """Whether the ETA changes with time alone (and so is worth writing though no output came)."""
        return self.estimate is not None or self.rate() is not None

"""Honest time left. tqdm's ETA divides by the average rate since the bar opened, warm-up included; here the
rate is measured over the recent steps only, and before training starts the estimate comes from the ledger's
history of similar jobs and says so."""
from __future__ import annotations

import statistics
from collections import deque

from lora_worker.states import Phase

WINDOW_STEPS = 50  # long enough to smooth step jitter, short enough to follow a change of pace
WINDOW_S = 120.0


def estimate_duration(history: list[float]) -> float | None:
    """The expected wall time of a job from the durations of similar finished jobs; None without history."""
    return statistics.median(history) if history else None


class EtaClock:
    """Turns (step, time) observations into a rate and time remaining, with the basis it rests on."""

    def __init__(self, total_steps: int, estimated_duration_s: float | None) -> None:
        self.total_steps = total_steps
        self.estimate = estimated_duration_s
        self._seen: deque[tuple[float, int]] = deque()

    def observe(self, step: int, now: float) -> None:
        """Record that `step` was reached at `now`. The window starts when the first step is seen, so the
        warm-up before it (the slowest step by far) never enters the rate."""
        if step <= 0 or (self._seen and self._seen[-1][1] >= step):
            return
        self._seen.append((now, step))
        while len(self._seen) > WINDOW_STEPS + 1 or (len(self._seen) > 2 and now - self._seen[0][0] > WINDOW_S):
            self._seen.popleft()

    def rate(self) -> float | None:
        """Optimizer steps per second over the recent window, or None until two steps past the first."""
        if len(self._seen) < 2:
            return None
        (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def eta(self, phase: Phase, step: int, elapsed_s: float) -> tuple[float | None, str | None]:
        """(seconds left, basis): "measured" once steps move, "history" before, (None, None) without either."""
        rate = self.rate() if phase in (Phase.TRAINING, Phase.SAVING) else None
        if rate:
            return max(0.0, (self.total_steps - step) / rate), "measured"
        if self.estimate is not None:
            return max(0.0, self.estimate - elapsed_s), "history"
        return None, None

"""The stall watchdog: each phase has its own limit on how long the trainer may show no sign of life.

In the quiet phases (loading, caching, saving) any output is life. In training only a new step is: a bar
redrawn on the same step for ever is a hung step, however chatty. The count starts when the trainer starts,
not when the supervisor did (a slow ledger before the start is not the trainer's silence).
"""
from __future__ import annotations

from collections.abc import Mapping

from lora_worker.transcript.parser import Progress
from lora_worker.states import Phase


class Watchdog:
    def __init__(self, limits_s: Mapping[str, float], now: float) -> None:
        self.limits_s = limits_s
        self.activity_at = now
        self.stalled_in: str | None = None  # the phase it fired in, once it has

    def restart(self, now: float) -> None:
        """The trainer starts now: silence counts from here."""
        self.activity_at = now

    def saw_output(self, phase_before: Phase, step_before: int, progress: Progress, now: float) -> None:
        if progress.phase is not phase_before or progress.step != step_before or progress.phase is not Phase.TRAINING:
            self.activity_at = now

    def check(self, phase: Phase, now: float) -> str | None:
        """Why the job stalled (and `stalled_in` set), or None while it has not."""
        limit = self.limits_s.get(phase.value)
        if limit is None or now - self.activity_at <= limit:
            return None
        self.stalled_in = phase.value
        return f"no progress in {phase.value} for {now - self.activity_at:.0f}s (limit {limit:g}s)"

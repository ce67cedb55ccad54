"""The ETA a user would have watched on the real sd-scripts captures: each run is replayed with its own timing
through the supervisor's output path (TrainerOutput: decoder, parser, run log) and the EtaClock, and the ETA
at 10, 50 and 90 % of the run is compared with the time that was really left (the capture's exit time).

Two histories: "cold" (the first job of its kind on the host: no estimate, the default tail) and "warm"
(a previous job of the same tier and device took as long: its wall time is the estimate and its last-step-to-
end time the tail). "previous" is the ETA the worker showed before issue #15 (no tail, history until two
steps, held between steps), and "tqdm" the bar's own. Reports, never fails on a number.

    python -m bench.eta_replay [--quick]
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import Row, record
from lora_worker.config import REPO_ROOT
from lora_worker.transcript.eta import DEFAULT_TAIL_S, EtaClock
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.output import TrainerOutput
from lora_worker.states import Phase

DATA = REPO_ROOT / "tests" / "data"
RUNS = ("run1_simple", "run5_epochs_saves")  # the captures that train to the end
POINTS = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class Capture:
    name: str
    end_s: float  # when the launcher exited: the job is over then
    chunks: list[tuple[float, bytes]]  # (seconds since spawn, bytes), in the order they were read

    @classmethod
    def load(cls, name: str) -> Capture:
        lines = (DATA / f"{name}.jsonl").read_text().splitlines()
        meta = json.loads(lines[0])["meta"]
        chunks = [(c["t"], base64.b64decode(c["b64"])) for c in map(json.loads, lines[1:])]
        # stdout and stderr were read apart; the worker reads them merged, in the order they were written
        chunks.sort(key=lambda c: c[0])
        return cls(name, float(meta["wall_s"]), chunks)


@dataclass(frozen=True)
class Sample:
    t: float
    phase: Phase
    step: int
    eta: float | None
    basis: str | None
    left: float  # what was really left
    previous: float | None
    tqdm: float | None


def replay(capture: Capture, *, estimate: float | None, tail_s: float, at: list[float]) -> list[Sample]:
    """The ETA at each time in `at` (sorted), as the supervisor would have written it then."""
    with tempfile.TemporaryDirectory(prefix="eta-replay-") as tmp:
        clock = EtaClock(total_steps=0, estimated_duration_s=estimate, tail_s=tail_s)
        old = _PreviousEta(estimate)
        now = [0.0]

        def on_output(_phase: Phase, _step: int) -> None:
            p = output.progress
            if p.total_steps and not clock.total_steps:
                clock.total_steps = p.total_steps  # the worker knows it from the tier; the capture says it here
            clock.follow(p.phase, p.step, now[0])
            old.follow(p.step, now[0])

        output = TrainerOutput(JobLog(Path(tmp), 1, head_bytes=1 << 20, tail_bytes=1 << 20), on_output)
        samples: list[Sample] = []
        pending = list(at)

        def sample_until(t: float) -> None:
            while pending and pending[0] < t:
                s = pending.pop(0)
                now[0] = s
                output.tick(s)
                p = output.progress
                eta, basis = clock.eta(p.phase, now=s, elapsed_s=s)
                samples.append(Sample(s, p.phase, p.step, eta, basis, capture.end_s - s,
                                      old.eta(p.phase, p.step, clock.total_steps, s), p.eta_s))

        for t, data in capture.chunks:
            sample_until(t)
            now[0] = t
            output.consume(data, t)
            output.tick(t)
        sample_until(capture.end_s)
        now[0] = capture.end_s
        output.end()
        output.joblog.close()
        return samples


class _PreviousEta:
    """The formula the worker used before issue #15, for comparison only."""

    def __init__(self, estimate: float | None) -> None:
        self.estimate = estimate
        self.seen: list[tuple[float, int]] = []

    def follow(self, step: int, now: float) -> None:
        if step > 0 and (not self.seen or self.seen[-1][1] < step):
            self.seen.append((now, step))

    def eta(self, phase: Phase, step: int, total: int, elapsed: float) -> float | None:
        if phase in (Phase.TRAINING, Phase.SAVING) and len(self.seen) >= 2:
            (t0, s0), (t1, s1) = self.seen[0], self.seen[-1]
            return max(0.0, (total - step) * (t1 - t0) / (s1 - s0))
        return None if self.estimate is None else max(0.0, self.estimate - elapsed)


def last_step_at(capture: Capture) -> float:
    """When the final step was first seen: the worker's tail history starts there."""
    samples = replay(capture, estimate=None, tail_s=DEFAULT_TAIL_S,
                     at=[i * 0.05 for i in range(int(capture.end_s / 0.05) + 1)])
    final = max(s.step for s in samples)
    return next(s.t for s in samples if s.step == final)


def histories(capture: Capture) -> dict[str, tuple[float | None, float]]:
    """(estimate, tail) per history: none yet, or a previous job just like this one."""
    return {"cold": (None, DEFAULT_TAIL_S), "warm": (capture.end_s, capture.end_s - last_step_at(capture))}


def at_points(capture: Capture, history: str) -> list[Sample]:
    estimate, tail = histories(capture)[history]
    return replay(capture, estimate=estimate, tail_s=tail, at=[capture.end_s * f for f in POINTS])


def _fmt(value: float | None, left: float) -> str:
    return "null" if value is None else f"{value:.1f} ({value - left:+.1f})"


def table(runs: tuple[str, ...], out: Callable[[str], object] = print) -> None:
    out("### ETA on the real captures: shown (error) in seconds; error = shown - really left")
    out("")
    out("| run | history | at | phase, step | really left | eta_s (basis) | previous worker | tqdm |")
    out("|---|---|---|---|---|---|---|---|")
    rows = []
    for name in runs:
        capture = Capture.load(name)
        for history in ("cold", "warm"):
            for fraction, s in zip(POINTS, at_points(capture, history)):
                out(f"| {name} ({capture.end_s:.0f} s) | {history} | {fraction:.0%} | {s.phase.value}, {s.step} "
                    f"| {s.left:.1f} | {_fmt(s.eta, s.left)} ({s.basis or '-'}) | {_fmt(s.previous, s.left)} "
                    f"| {_fmt(s.tqdm, s.left)} |")
                rows.append(Row(f"{name}, {history} history, at {fraction:.0%}: eta_s error (shown - really left)",
                                _error_cell(s.eta, s.left), f"{_error_cell(s.previous, s.left)} (previous worker)"))
    record("ETA on the real captures", rows)


def _error_cell(value: float | None, left: float) -> str:
    return "null" if value is None else f"{value - left:+.1f} s"


def spans(runs: tuple[str, ...], out: Callable[[str], object] = print) -> None:
    """Mean and worst |error| over every half second of each run: from the first step, and after the last."""
    out("### ETA error over the whole run, sampled every 0.5 s: mean |error| / worst |error|, seconds")
    out("")
    out("| run | history | from step 1 to the end: eta_s | previous worker | after the last step: eta_s "
        "| previous worker |")
    out("|---|---|---|---|---|---|")
    for name in runs:
        capture = Capture.load(name)
        for history in ("cold", "warm"):
            estimate, tail = histories(capture)[history]
            samples = replay(capture, estimate=estimate, tail_s=tail,
                             at=[i * 0.5 for i in range(1, int(capture.end_s / 0.5) + 1)])
            final = max(s.step for s in samples)
            stepped = [s for s in samples if s.step >= 1]
            after = [s for s in stepped if s.step == final]
            out(f"| {name} | {history} | {_errors(stepped, 'eta')} | {_errors(stepped, 'previous')} "
                f"| {_errors(after, 'eta')} | {_errors(after, 'previous')} |")


def _errors(samples: list[Sample], which: str) -> str:
    errors = [abs(v - s.left) for s in samples if (v := getattr(s, which)) is not None]
    return f"{sum(errors) / len(errors):.1f} / {max(errors):.1f}" if errors else "-"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one capture only (the smoke test)")
    args = parser.parse_args(argv)
    runs = RUNS[:1] if args.quick else RUNS
    table(runs)
    print()
    spans(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

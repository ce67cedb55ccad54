"""Keeping a running job's row current, for every backend: phase, step, loss, rate, ETA and the loss points.

Written about once `interval_s`, and at once on a phase change. Progress can wait; the trainer must not: a
write the ledger refuses (locked, full) keeps its points and values in memory for the next one. The ledger is
whatever the process writes with (the supervisor's sqlite3 ledger, the Slurm poller's): anything with
`update_running`. Elapsed time counts from `started` (the row's start, on the caller's monotonic clock), so
a poller that attaches late to a job still bases its ETA on how long the job has really run.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Protocol

from lora_worker.ledger.checkpoints import CheckpointRow
from lora_worker.ledger.samples import SamplePass
from lora_worker.ledger.statements import utcnow
from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.eta import EtaClock
from lora_worker.transcript.output import TrainerOutput
from lora_worker.transcript.persist import TRANSIENT
from lora_worker.transcript.samples import Samples
from lora_worker.states import Phase

log = logging.getLogger(__name__)
Point = tuple[int, float | None, datetime]


class ProgressLedger(Protocol):
    def update_running(self, job_id: int, *, points: Iterable[Point] = (), phases: Sequence[Phase] = (),
                       checkpoints: Iterable[CheckpointRow] = (), samples: Iterable[SamplePass] = (),
                       **values: object) -> bool:
        """Write progress of a running job; False once it is no longer running."""


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class ProgressReporter:
    """`on_lost` is called when the ledger says the job is no longer running (someone else ended it)."""

    def __init__(self, db: ProgressLedger, job_id: int, host: Clock, output: TrainerOutput, clock: EtaClock,
                 interval_s: float, on_lost: Callable[[], None], started: float | None = None,
                 checkpoints: Checkpoints | None = None, samples: Samples | None = None) -> None:
        self.db = db
        self.job_id = job_id
        self.host = host
        self.output = output
        self.clock = clock
        self.interval_s = interval_s
        self.on_lost = on_lost
        self.started = host.monotonic() if started is None else started  # the run's start, for the ETA
        self.last_write = 0.0
        self.pending_points: dict[int, float | None] = {}
        self.pending_values: dict[str, object] = {}  # written with the next progress write that lands
        self.training_at: datetime | None = None
        self.checkpoints = checkpoints  # the step LoRAs and states: recorded (and verified) with the progress
        self.pending_checkpoints: dict[tuple[str, str], CheckpointRow] = {}
        self.samples = samples  # the sample passes over: recorded with the progress, after their step LoRAs
        self.pending_samples: list[SamplePass] = []

    def keep(self, **values: object) -> None:
        """Values to write with the next write that lands, however many fail before it."""
        self.pending_values.update(values)

    def due(self, now: float) -> bool:
        return now - self.last_write >= self.interval_s

    def flush(self, force: bool = False) -> bool:
        """Write the progress if it changed and is due (or `force`); False if the ledger did not take it."""
        for step, loss in self.output.parser.take_points():
            self.pending_points[step] = loss
        if self.clock.moves():
            self.output.changed = True  # the ETA counts down with the clock, output or not
        self._take_checkpoints()
        pending = (self.output.changed or self.pending_points or self.pending_values or self.pending_checkpoints
                   or self.pending_samples)
        if not pending or (not force and not self.due(self.host.monotonic())):
            return True
        at = utcnow()
        points = [(step, finite(loss), at) for step, loss in sorted(self.pending_points.items())]
        if not self.write(points=points, checkpoints=list(self.pending_checkpoints.values()),
                          samples=self.pending_samples, **self._values(at)):
            return False
        self.pending_points.clear()
        self.pending_checkpoints.clear()
        self.pending_samples = []
        self.output.changed = False
        return True

    def _take_checkpoints(self) -> None:
        """The saves seen since the last flush, written with it (the step LoRAs now complete verified first)."""
        if self.checkpoints is not None:
            for row in self.checkpoints.take(self.output.progress, ended=self.output.ended):
                self.pending_checkpoints[(row.kind, row.path)] = row
        if self.samples is not None:
            lora_at = self.checkpoints.lora_at if self.checkpoints is not None else (lambda _step: None)
            self.pending_samples += self.samples.take(self.output.progress, ended=self.output.ended, lora_of=lora_at)

    def write(self, points: list[Point] | None = None, checkpoints: Sequence[CheckpointRow] = (),
              samples: Sequence[SamplePass] = (), **values: object) -> bool:
        self.last_write = self.host.monotonic()
        phases = self.output.progress.phases  # every phase entered: the ledger records those it has not yet
        try:
            if not self.db.update_running(self.job_id, points=points or (), phases=phases, checkpoints=checkpoints,
                                          samples=samples, **self.pending_values, **values):
                self.on_lost()
            self.pending_values = {}
            return True
        except TRANSIENT as exc:
            # Progress can wait; the trainer must not. Kept in memory and written at the next tick.
            log.warning("job %s: progress not written (%s); will retry", self.job_id, exc)
            return False

    def _values(self, at: datetime) -> dict[str, object]:
        p = self.output.progress
        now = self.host.monotonic()
        eta, basis = self.clock.eta(p.phase, now=now, elapsed_s=now - self.started)
        values: dict[str, object] = {
            "phase": p.phase.value, "step": p.step, "loss": finite(p.loss), "rate": self.clock.rate() or p.rate,
            "eta_s": eta, "eta_basis": basis, "last_progress_at": at,
        }
        if p.total_steps:
            values["total_steps"] = p.total_steps
        if p.phase is Phase.TRAINING and self.training_at is None:
            self.training_at = at  # when the steps bar first showed; written with every flush after
        if self.training_at is not None:
            values["training_started_at"] = self.training_at
        return values


def finite(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) or math.isinf(value) else value

"""The Slurm poller's ledger, in the shape the follower writes through (transcript/follower.py's
`FollowerLedger`): the web's ledger, every event by actor "slurm".

A Slurm row ends outside `queued`/`running` with its `queue_reason` cleared, whatever the outcome.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import utcnow
from lora_worker.states import FailureClass, JobState, Phase

ACTOR = "slurm"


@dataclass
class SlurmLedger:
    db: Database

    def update_running(self, job_id: int, *, points: Iterable[tuple[int, float | None, datetime]] = (),
                       phases: Sequence[Phase] = (), **values: object) -> bool:
        return repo.update_running(self.db, job_id, points=points, phases=phases, actor=ACTOR, **values)

    def mark_running(self, job_id: int) -> bool:
        return repo.transition(self.db, job_id, JobState.RUNNING, actor=ACTOR, reason="Slurm started the job",
                               started_at=utcnow(), phase=Phase.LAUNCHING.value, queue_reason=None)

    def note(self, job_id: int, reason: str) -> None:
        repo.note(self.db, job_id, reason, actor=ACTOR)

    def save_and_teardown_durations(self, *, backend: str, tier: str, device_index: int | None) -> list[float]:
        # Slurm places the job, not the row's device_index: any card of the backend's history counts.
        return repo.save_and_teardown_durations(self.db, backend=backend, tier=tier, device_index=None)

    def record_queue_reason(self, job_id: int, reason: str | None) -> None:
        repo.record_queue_reason(self.db, job_id, reason)

    def mark_succeeded(self, job_id: int, *, reason: str, **values: object) -> bool:
        return repo.transition(self.db, job_id, JobState.SUCCEEDED, actor=ACTOR, reason=reason, queue_reason=None,
                               **values)

    def mark_cancelled(self, job_id: int, *, reason: str, **values: object) -> bool:
        return repo.transition(self.db, job_id, JobState.CANCELLED, actor=ACTOR, reason=reason, queue_reason=None,
                               **values)

    def fail_job(self, job_id: int, *, failure_class: FailureClass, sentence: str, log_lines: Iterable[str] = (),
                 **values: object) -> bool:
        return repo.fail_job(self.db, job_id, actor=ACTOR, failure_class=failure_class, sentence=sentence,
                             log_lines=tuple(log_lines), queue_reason=None, **values)

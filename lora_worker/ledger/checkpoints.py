"""The `checkpoints` rows (migration 0013): the step LoRAs and states a running job's trainer announced, written
with its progress (statements.update_running_in), on the DB-API alone like every statement both paths run.

A row is keyed by (job, kind, path), so a write the ledger refused and made again, or a Slurm poller that
re-read the log from its start, leaves one row per save. A later write adds what became known: a verification
(which replaces an earlier one), the trainer's removal (kept once set).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from lora_worker.ledger.timestamps import iso_utc

if TYPE_CHECKING:
    from lora_worker.ledger.statements import Statements

LORA = "lora"
STATE = "state"


@dataclass(frozen=True)
class CheckpointRow:
    kind: str  # LORA | STATE
    step: int
    path: str
    at: datetime  # when its save line was seen
    bytes: int | None = None
    sha256: str | None = None
    verified: bool | None = None  # None: not checked (not yet, or a state)
    error: str | None = None
    removed_at: datetime | None = None


UPSERT_SQL = (
    "INSERT INTO checkpoints (job_id, kind, step, path, at, bytes, sha256, verified, error, removed_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, kind, path) DO UPDATE SET "
    "bytes = CASE WHEN excluded.verified IS NULL THEN checkpoints.bytes ELSE excluded.bytes END, "
    "sha256 = CASE WHEN excluded.verified IS NULL THEN checkpoints.sha256 ELSE excluded.sha256 END, "
    "error = CASE WHEN excluded.verified IS NULL THEN checkpoints.error ELSE excluded.error END, "
    "verified = coalesce(excluded.verified, checkpoints.verified), "
    "removed_at = coalesce(checkpoints.removed_at, excluded.removed_at)"
)


def record_in(db: Statements, job_id: int, rows: Iterable[CheckpointRow]) -> None:
    params = [(job_id, r.kind, r.step, r.path, iso_utc(r.at), r.bytes, r.sha256, r.verified, r.error,
               iso_utc(r.removed_at) if r.removed_at else None) for r in rows]
    if params:
        db.executemany(UPSERT_SQL, params)

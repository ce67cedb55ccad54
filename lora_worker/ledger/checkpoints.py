"""The `checkpoints` rows (migration 0013): the step LoRAs and states a running job's trainer announced, written
with its progress (statements.update_running_in), on the DB-API alone like every statement both paths run.

A row is keyed by (job, kind, path), so a write the ledger refused and made again, or a Slurm poller that
re-read the log from its start, leaves one row per save. A later write adds what became known: a verification
(which replaces an earlier one), the trainer's removal (kept once set).

The first verification a step LoRA's row gets is what its `job.checkpoint` webhook event tells (`record_in`
returns those rows; update_running_in writes their events in the same transaction): decided by the row the
ledger holds, not by the writer's memory, so a write made again or a re-read log never tells it twice.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

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


_VERIFIED_SQL = "SELECT verified FROM checkpoints WHERE job_id = ? AND kind = ? AND path = ?"


def record_in(db: Statements, job_id: int, rows: Iterable[CheckpointRow]) -> list[CheckpointRow]:
    """Write the rows; the step LoRAs among them whose verification the ledger had not recorded before (read
    before the write, in the caller's transaction): each is one `job.checkpoint` event, whatever its outcome."""
    rows = list(rows)
    first = [r for r in _verifications(rows) if _unverified(db, job_id, r.path)]
    params = [(job_id, r.kind, r.step, r.path, iso_utc(r.at), r.bytes, r.sha256, r.verified, r.error,
               iso_utc(r.removed_at) if r.removed_at else None) for r in rows]
    if params:
        db.executemany(UPSERT_SQL, params)
    return first


def _unverified(db: Statements, job_id: int, path: str) -> bool:
    known = db.execute(_VERIFIED_SQL, (job_id, LORA, path)).fetchone()
    return known is None or known[0] is None


def _verifications(rows: list[CheckpointRow]) -> list[CheckpointRow]:
    """The verified rows of one write, one per step LoRA: the last, which the upsert leaves (a caller may name
    one twice)."""
    seen: dict[str, CheckpointRow] = {}
    for row in rows:
        if row.kind == LORA and row.verified is not None:
            seen[row.path] = row
    return list(seen.values())


def event_data(row: CheckpointRow) -> dict[str, Any]:
    """The step LoRA as its `job.checkpoint` event tells it: `checkpoint` beside the job's fields, in the shape
    `GET /train/<id>` lists it (`checkpoints: [...]`)."""
    return {"step": row.step, "path": row.path, "bytes": row.bytes, "sha256": row.sha256,
            "verified": bool(row.verified), "error": row.error}

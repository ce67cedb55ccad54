"""The `samples` rows (migration 0017): each image a job's trainer drew in a sample pass, as its follower found and
decoded it (transcript/samples.py), written with the progress (statements.update_running_in); and a promotion:
a verified step LoRA made the job's result. DB-API only, like every statement both ledger paths run.

A pass is written once it is over (its images whole, its step LoRA saved and judged), all its images in one
write. The first write of a pass is its `job.sample` webhook event: decided by the rows the ledger holds, not by
the writer's memory, so a write made again (a refused write, a Slurm poller that re-read the log) tells it once.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from lora_worker.ledger import outbox
from lora_worker.ledger.timestamps import iso_utc, parse_utc, utcnow

if TYPE_CHECKING:
    from lora_worker.ledger.statements import Statements

SAMPLE = "job.sample"
PROMOTED = "job.promoted"


@dataclass(frozen=True)
class SampleRow:
    name: str  # in <output_dir>/sample/
    step: int  # 0: the pass before the first step
    prompt_index: int
    seed: int | None
    width: int
    height: int
    bytes: int
    sha256: str
    at: datetime  # when the follower found it
    job_id: int | None = None  # set when read back (a listing spans the jobs a resume continues)


@dataclass(frozen=True)
class SamplePass:
    """The images of one pass, and the step LoRA saved right after it (its `job.checkpoint` data; None at step 0,
    or when the trainer never wrote it)."""

    step: int
    images: tuple[SampleRow, ...]
    expected: int  # the job's prompts: a pass cut short has fewer images
    lora: dict[str, Any] | None = field(default=None)


_INSERT_SQL = ("INSERT INTO samples (job_id, name, step, prompt_index, seed, width, height, bytes, sha256, at) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, name) DO NOTHING")
_KNOWN_SQL = "SELECT count(*) FROM samples WHERE job_id = ? AND step = ?"


def record_in(db: Statements, job_id: int, passes: Iterable[SamplePass]) -> list[dict[str, Any]]:
    """Write the passes' images; the event data of each pass the ledger had no image of before."""
    first: list[dict[str, Any]] = []
    for one in passes:
        if not one.images:
            continue
        if db.execute(_KNOWN_SQL, (job_id, one.step)).fetchone()[0] == 0:
            first.append(event_data(one))
        db.executemany(_INSERT_SQL, [(job_id, r.name, r.step, r.prompt_index, r.seed, r.width, r.height, r.bytes,
                                      r.sha256, iso_utc(r.at)) for r in one.images])
    return first


def image_data(row: SampleRow) -> dict[str, Any]:
    return {"name": row.name, "step": row.step, "prompt_index": row.prompt_index, "seed": row.seed,
            "width": row.width, "height": row.height, "bytes": row.bytes, "sha256": row.sha256}


def event_data(one: SamplePass) -> dict[str, Any]:
    """A pass as its `job.sample` event tells it (`sample` beside the job's fields)."""
    return {"step": one.step, "expected": one.expected, "images": [image_data(r) for r in one.images],
            "lora": one.lora}


_ROWS_SQL = ("SELECT job_id, name, step, prompt_index, seed, width, height, bytes, sha256, at FROM samples "
             "WHERE job_id = ? ORDER BY step, prompt_index, id")


def rows_in(db: Statements, job_ids: Sequence[int]) -> list[SampleRow]:
    """The images of these jobs, each job's by step and prompt."""
    found: list[SampleRow] = []
    for job_id in job_ids:
        for r in db.execute(_ROWS_SQL, (job_id,)).fetchall():
            found.append(SampleRow(r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], parse_utc(r[9]) or utcnow(),
                                   job_id=r[0]))
    return found


_PROMOTE_SQL = ("UPDATE jobs SET lora_path = ?, lora_sha256 = ?, lora_size = ?, promoted_step = ?, updated_at = ?, "
                "version = version + 1 WHERE id = ? AND status = 'succeeded'")


def promote_in(db: Statements, job_id: int, *, step: int, path: str, sha256: str, size: int, actor: str) -> bool:
    """Make the verified step LoRA at `path` the succeeded job's result, with its event and its `job.promoted`
    webhook event; False when the job is not (or no longer) `succeeded`."""
    from lora_worker.ledger.statements import record_event
    from lora_worker.states import JobState

    if db.execute(_PROMOTE_SQL, (path, sha256, size, step, iso_utc(utcnow()), job_id)).rowcount != 1:
        return False
    record_event(db, job_id, JobState.SUCCEEDED, JobState.SUCCEEDED, actor,
                 f"promoted the step LoRA of step {step} to the result: {path}")
    outbox.emit(db, job_id, PROMOTED, promoted={"step": step, "path": path, "sha256": sha256, "bytes": size})
    return True

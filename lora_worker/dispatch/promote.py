"""Choosing a step (issue 33, docs/samples.md): `POST /train/<id>/promote {"step": N}` makes the verified step LoRA
of step N the succeeded job's result, without training again: `lora_path`, `lora_sha256` and `lora_size` become
that file's, `promoted_step` says which, an event and a `job.promoted` webhook event say so. Until then the final
LoRA is the result.

Only a step LoRA the follower verified (transcript/checkpoints.py) and the trainer did not prune, of the job or of
the jobs it resumed (they share the output directory), and only as the file it verified: it is verified again now
(header, rank, dtype, name, seed, its step, opened without following a link in the recorded output directory) and
its sha256 must be the one recorded. The same step asked again changes nothing (idempotent). Each refusal is a 422
`not_promotable` whose `details.reason` is one of errors.PROMOTE_REASONS.
"""
from __future__ import annotations

from pathlib import Path

from lora_worker.dispatch.gallery import chain
from lora_worker.errors import PROMOTE_REASONS, NotPromotable
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Checkpoint, Job
from lora_worker.ledger.samples import promote_in
from lora_worker.states import JobState
from lora_worker.transcript.checkpoints import verify_step_lora
from lora_worker.transcript.outcome import recorded_lora


def refuse(job: Job, step: int, reason: str, detail: str = "") -> NotPromotable:
    text = f"Job {job.id} cannot take the step LoRA of step {step} as its result: {PROMOTE_REASONS[reason]}"
    return NotPromotable(text + (f" ({detail})" if detail else ""), job_id=job.id, step=step, reason=reason)


def step_lora(db: Database, job: Job, step: int) -> Checkpoint:
    """The step LoRA of `step` the job (or a job it resumed) saved and verified, still on disk by the ledger."""
    if job.status != JobState.SUCCEEDED.value:
        raise refuse(job, step, "job_not_succeeded", f"it is {job.status}")
    found = _saved(db, job, step)
    if not found:
        raise refuse(job, step, "no_step_lora")
    kept = [c for c in found if c.removed_at is None]
    if not kept:
        raise refuse(job, step, "removed")
    verified = [c for c in kept if c.verified and c.sha256]
    if not verified:
        raise refuse(job, step, "not_verified", kept[0].error or "")
    return verified[0]


def _saved(db: Database, job: Job, step: int) -> list[Checkpoint]:
    """The step LoRAs of `step` the job and the jobs it resumed saved, newest job first."""
    return [c for j in chain(db, job) for c in j.checkpoints if c.kind == "lora" and c.step == step]


def promote(db: Database, job: Job, step: int, *, actor: str = "api") -> tuple[Job, bool]:
    """The job with the step LoRA of `step` as its result, and whether this call changed it."""
    lora = step_lora(db, job, step)
    if job.promoted_step == step and job.lora_path == lora.path and job.lora_sha256 == lora.sha256:
        return job, False
    problem, check = verify_step_lora(Path(lora.path), recorded_lora(job), step)
    if problem is not None or check.sha256 is None or check.sha256 != lora.sha256 or check.size is None:
        raise refuse(job, step, "file_changed", problem or f"sha256 {check.sha256} instead of {lora.sha256}")
    with db.writing() as d:
        if not promote_in(d, job.id, step=step, path=lora.path, sha256=check.sha256, size=check.size, actor=actor):
            raise refuse(job, step, "job_not_succeeded", "it ended otherwise meanwhile")
    return repo.get_job(db, job.id), True

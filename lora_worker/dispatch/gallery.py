"""A job's sample images as a client sees them (issue 33, docs/samples.md): the listing of `GET
/train/<id>/samples`, one image's bytes, and the contact sheet.

A resume shares its original's output directory and continues its run, so a job's listing spans the jobs it
resumed: each image with the job whose trainer drew it, its prompt, and the step LoRA that same job saved right
after the pass (the images of step N are drawn with the weights of that step LoRA; step 0 is the base model's).
An image is served only as the bytes the follower decoded and hashed: the file is read without following a link,
bounded, and its sha256 compared with the listed one (410 `sample_gone` otherwise).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

from lora_worker.errors import SampleGone, SampleNotFound
from lora_worker.host import images
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Checkpoint, Job
from lora_worker.ledger.samples import SampleRow, image_data, rows_in
from lora_worker.transcript.samples import sample_every_of

MAX_CHAIN = 100


def chain(db: Database, job: Job) -> list[Job]:
    """The job and the jobs it resumed, newest first (they share the output directory)."""
    jobs = [job]
    while jobs[-1].resumed_from is not None and len(jobs) < MAX_CHAIN:
        earlier = repo.find_job(db, jobs[-1].resumed_from)
        if earlier is None:
            break
        jobs.append(earlier)
    return jobs


def _images(db: Database, jobs: list[Job]) -> list[SampleRow]:
    """Each image once (by name: the newest job's row), by step, prompt and job."""
    with db.reading() as d:
        rows = rows_in(d, [j.id for j in jobs])
    order = {j.id: i for i, j in enumerate(jobs)}
    seen: dict[str, SampleRow] = {}
    for row in sorted(rows, key=lambda r: order[r.job_id or 0]):
        seen.setdefault(row.name, row)
    return sorted(seen.values(), key=lambda r: (r.step, r.prompt_index, order[r.job_id or 0]))


def _lora(found: Checkpoint | None) -> dict[str, Any] | None:
    if found is None:
        return None
    return {"step": found.step, "path": found.path, "sha256": found.sha256, "bytes": found.bytes,
            "verified": found.verified, "removed": found.removed_at is not None, "job_id": found.job_id}


def listing(db: Database, job: Job) -> dict[str, Any]:
    jobs = chain(db, job)
    loras = {(c.job_id, c.step): c for j in jobs for c in j.checkpoints if c.kind == "lora"}
    prompts = {j.id: list(j.sample_prompts or ()) for j in jobs}
    shown = []
    for row in _images(db, jobs):
        drawn = prompts.get(row.job_id or 0, [])
        prompt = drawn[row.prompt_index]["prompt"] if row.prompt_index < len(drawn) else None
        shown.append({**image_data(row), "prompt": prompt, "job_id": row.job_id,
                      "lora": _lora(loras.get((row.job_id or 0, row.step))) if row.step > 0 else None})
    return {"worker_job_id": job.id, "prompts": list(job.sample_prompts or ()),
            "sample_every_n_steps": sample_every_of(job.argv), "promoted_step": job.promoted_step,
            "images": shown, "contact_sheet": f"/train/{job.id}/samples.png"}


def _read(jobs: dict[int, Job], row: SampleRow) -> bytes:
    """The image's bytes as listed, or SampleGone."""
    drew = jobs[row.job_id or 0]
    try:
        dir_fd = images.open_sample_dir(drew.output_dir, drew.output_dev_ino)
        try:
            data = images.read_sample(dir_fd, row.name)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise SampleGone(f"Sample image {row.name} cannot be read as it was listed: {exc}.", name=row.name) from exc
    if hashlib.sha256(data).hexdigest() != row.sha256:
        raise SampleGone(f"Sample image {row.name} is not the file that was listed: its bytes changed.",
                         name=row.name)
    return data


def image(db: Database, job: Job, name: str) -> bytes:
    jobs = chain(db, job)
    row = next((r for r in _images(db, jobs) if r.name == name), None)
    if row is None:
        raise SampleNotFound(f"Job {job.id} has no sample image {name!r}.", job_id=job.id)
    return _read({j.id: j for j in jobs}, row)


def _cells(jobs: dict[int, Job], rows: list[SampleRow], count: int) -> Iterator[bytes | None]:
    by_index = {r.prompt_index: r for r in rows}
    for index in range(count):
        row = by_index.get(index)
        if row is None:
            yield None
            continue
        try:
            yield _read(jobs, row)
        except SampleGone:
            yield None  # a grey cell: the sheet shows what can still be read as it was listed


def _columns(job: Job, rows: list[SampleRow]) -> list[str]:
    """One label per prompt: its index and text (a prompt an earlier job of the chain had beyond the job's own,
    its index alone)."""
    prompts = [p["prompt"] for p in (job.sample_prompts or ())]
    count = max(len(prompts), 1 + max(r.prompt_index for r in rows))
    return [f"{i}: {prompts[i]}" if i < len(prompts) else str(i) for i in range(count)]


def sheet(db: Database, job: Job) -> bytes:
    """The contact sheet: the steps as rows (at most images.MAX_SHEET_ROWS), the prompts as columns."""
    jobs = chain(db, job)
    rows = _images(db, jobs)
    if not rows:
        raise SampleNotFound(f"Job {job.id} has no sample images yet.", job_id=job.id)
    columns, by_job = _columns(job, rows), {j.id: j for j in jobs}
    drawn = []
    for step in images.sheet_rows(sorted({r.step for r in rows})):
        cells = list(_cells(by_job, [r for r in rows if r.step == step], len(columns)))
        drawn.append(("base model" if step == 0 else f"step {step}", cells))
    return images.contact_sheet(drawn, columns)

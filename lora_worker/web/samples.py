"""The sample routes (issue 33, docs/samples.md): a job's images listed, one image served, the contact sheet, and
the promotion of a verified step LoRA to the job's result."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify

from lora_worker.web import worker
from lora_worker.web.schemas.samples import PromotedSchema, PromoteSchema, SamplesSchema
from lora_worker.web.train import _json_body

bp = Blueprint("samples", __name__)
PNG = "image/png"


@bp.get("/train/<int:job_id>/samples")
def samples(job_id: int) -> Response:
    return jsonify(SamplesSchema().dump(worker().samples(job_id)))


@bp.get("/train/<int:job_id>/samples/<name>")
def sample_image(job_id: int, name: str) -> Response:
    """The image's bytes, as the listing's sha256 says (410 `sample_gone` when the file changed since)."""
    return _png(worker().sample_image(job_id, name))


@bp.get("/train/<int:job_id>/samples.png")
def contact_sheet(job_id: int) -> Response:
    return _png(worker().contact_sheet(job_id))


@bp.post("/train/<int:job_id>/promote")
def promote(job_id: int) -> tuple[Response, int]:
    """200 with the job's result now: the verified step LoRA of `step` (`changed` false when it was already)."""
    step = PromoteSchema().load(_json_body())["step"]  # type: ignore[arg-type]
    job, changed = worker().promote(job_id, step)
    body = {"worker_job_id": job.id, "promoted_step": job.promoted_step, "lora_path": job.lora_path,
            "lora_sha256": job.lora_sha256, "lora_size": job.lora_size, "changed": changed}
    return jsonify(PromotedSchema().dump(body)), 200


def _png(data: bytes) -> Response:
    response = Response(data, mimetype=PNG)
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response

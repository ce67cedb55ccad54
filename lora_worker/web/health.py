"""GET /healthz: liveness and the active jobs' ids (`active_job_ids`, oldest first: several under Slurm; and
`active_job_id`, the oldest, as before). Open without a token; it carries no job data.

200 with `status: ok`, or 503 with `status: failing` when the service cannot work as it claims (the ledger
file deleted or replaced under it): the install script's health gate and any monitor see the difference."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify

from lora_worker.web import worker
from lora_worker.web.schemas import HealthSchema

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    health = worker().health()
    response = jsonify(HealthSchema().dump(health))
    response.status_code = 200 if health["status"] == "ok" else 503
    return response

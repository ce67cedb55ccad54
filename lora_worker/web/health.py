"""GET /healthz: liveness and the active job id. Open without a token; it carries no job data."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify

from lora_worker.web import worker
from lora_worker.web.schemas import HealthSchema

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify(HealthSchema().dump(worker().health()))

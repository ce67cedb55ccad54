"""GET /gpu-status: per-device VRAM and processes through NVML, and whether the TTS service is live."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify

from lora_worker.web import worker
from lora_worker.web.schemas.gpu import GpuStatusSchema

bp = Blueprint("gpu", __name__)


@bp.get("/gpu-status")
def gpu_status() -> Response:
    return jsonify(GpuStatusSchema().dump(worker().gpu_status()))

"""GET /healthz: liveness and the active job id. Open without a token; it carries no job data.

200 with `status: ok`, or 503 with `status: failing` when the service cannot work as it claims (the ledger
file deleted or replaced under it): the install script's health gate and any monitor see the difference.

`?deep=1` adds the deep checks the service ran once at start-up (dispatch/readiness.py: bwrap's namespaces,
NVML's process lists, the device nodes, the trainer outside what the unit hides, torch and CUDA in the sandbox),
read from memory, never run by the request: 200 only when the host can train; 503 while they are still
running (`pending`) or when one failed. The deploy gate polls this."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from lora_worker.web import worker
from lora_worker.web.schemas import HealthSchema

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    health = worker().health()
    deep = request.args.get("deep", "") not in ("", "0", "false")
    if deep:
        health["deep"] = worker().deep_health.result()
    response = jsonify(HealthSchema().dump(health))
    ok = health["status"] == "ok" and (not deep or health["deep"]["status"] == "ok")
    response.status_code = 200 if ok else 503
    return response

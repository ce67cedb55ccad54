"""GET /healthz: liveness and the active jobs' ids (`active_job_ids`, oldest first: several under Slurm; and
`active_job_id`, the oldest, as before). Open without a token; it carries no job data.

200 with `status: ok`, or a 503 `ledger_replaced` in the one error shape when the service cannot work as it
claims (the ledger file deleted or replaced under it), with what it saw in `details` (`health: failing`, the
ledger's problem): the install script's health gate and any monitor see the difference.

It only reads (the ledger's identity, the active job's row, NVML): no reconcile, no write, no signal. Reconcile
runs at start-up, from the web process's timer and on authenticated requests (web/service.py).

`?deep=1` adds the deep checks the service ran once at start-up (dispatch/readiness.py: bwrap's namespaces,
NVML's process lists, the device nodes, the trainer outside what the unit hides, torch and CUDA in the sandbox;
under Slurm the cluster's, slurm/health.py), read from memory, never run by the request: 200 only when jobs can
run; a 503 `host_not_ready` while they are still running (`pending`) or when one failed. What could not be
checked is listed in `unchecked` (a 200 still; `doctor --strict` fails on it). The deploy gate polls this."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from lora_worker.web import worker
from lora_worker.web.errors import error_response
from lora_worker.web.schemas.gpu import HealthSchema

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    health = worker().health()
    if health["status"] != "ok":
        details = {"health": health["status"], **{k: v for k, v in health.items() if k != "status"}}
        return error_response(503, "ledger_replaced", f"The service cannot work as it claims: {health['ledger']}.",
                              details=details)
    if request.args.get("deep", "") not in ("", "0", "false"):
        health["deep"] = deep = worker().deep_health.result()
        if deep["status"] != "ok":
            failed = ", ".join(deep.get("failed") or ()) or deep["status"]
            return error_response(503, "host_not_ready", f"This host cannot train yet: {failed}.",
                                  details={"deep": deep})
    return jsonify(HealthSchema().dump(health))

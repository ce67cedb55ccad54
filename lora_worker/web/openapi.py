"""GET /openapi.json: the API described from the app's own URL map and its marshmallow schemas (apispec).

Each route's endpoint has one entry in `DOCS`: what it takes, what it answers, and which errors it can give
by name; their statuses, `retryable` and `Retry-After` come from `web.errors.CATALOGUE`, listed whole under the
document's `x-errors` and per response under its own `x-errors` (every error in the one `Error` shape).
Paths, path parameters and methods come from `app.url_map`, so the document follows the routes; a test fails
when a route has no entry here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify
from marshmallow import Schema
from werkzeug.routing import Rule

from lora_worker.config import WEBHOOK_EVENT_TYPES
from lora_worker.states import CANCEL_RULE
from lora_worker.web.auth import OPEN_ENDPOINTS
from lora_worker.web.deliveries import DeliveriesSchema, DeliverySchema
from lora_worker.web.errors import BY_CODE, CATALOGUE, ErrorEntry
from lora_worker.web.schemas.errors import ErrorSchema
from lora_worker.web.schemas.gpu import GpuStatusSchema, HealthSchema
from lora_worker.web.schemas.job import (
    AcceptedSchema,
    CancelAnswerSchema,
    CancelQuerySchema,
    JobListQuerySchema,
    JobListSchema,
    JobSchema,
    StatusQuerySchema,
    TrainRequestSchema,
)
from lora_worker.web.schemas.plan import FindingSchema, PlanSchema, SubmitQuerySchema
from lora_worker.web.schemas.resume import ResumeAcceptedSchema, ResumeVerdictSchema
from lora_worker.web.schemas.samples import PromotedSchema, PromoteSchema, SamplesSchema
from lora_worker.web.schemas.log import LogQuerySchema, LogSchema, ProgressQuerySchema, ProgressSeriesSchema

bp = Blueprint("openapi", __name__)

OPENAPI_VERSION = "3.0.3"
JSON = "application/json"
METRICS_MEDIA_TYPE = "text/plain"
LEDGER = ("ledger_busy", "ledger_unwritable", "ledger_replaced")  # any route that reads the ledger
PATH_PARAMETER_TYPES = {"int": {"type": "integer", "minimum": 0}, "float": {"type": "number"}}
RULE_ARGUMENT = re.compile(r"<(?:(?P<converter>[^:<>(]+)(?:\([^)]*\))?:)?(?P<name>[^<>]+)>")


@dataclass(frozen=True)
class Doc:
    """One operation: its success status and body, what it reads, and the errors it may answer."""

    summary: str
    status: int
    response: type[Schema] | dict[str, Any]  # a dump schema, or a raw OpenAPI schema for non-marshmallow bodies
    errors: tuple[str, ...] = LEDGER  # error names (`error` in the body), from web.errors.CATALOGUE
    body: type[Schema] | None = None
    query: type[Schema] | None = None
    parameters: tuple[dict[str, Any], ...] = ()  # other OpenAPI parameter objects, e.g. a request header
    media_type: str = JSON
    also: dict[int, str] | None = None  # other success statuses with the same body, and when they come
    headers: dict[str, Any] | None = None  # headers of the success response (OpenAPI header objects)
    also_schema: dict[str, Any] | None = None  # the body of the `also` statuses, when not `response`


IDEMPOTENCY_KEY = {
    "in": "header", "name": "Idempotency-Key", "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[\\x21-\\x7e]+$"},
    "description": "Retry safely: the same key with the same body returns the original job (200); "
                   "with another body it is a 422. Keys expire with the ledger's retention.",
}


SUBMIT_ERRORS = ("bad_request", "request_timeout", "length_required", "request_entity_too_large",
                 "validation_failed", "dataset_invalid", "base_model_invalid", "idempotency_key_reused",
                 "output_exists", "job_active", "insufficient_vram", "gpu_busy", "gpu_locked", "insufficient_disk",
                 "trainer_unavailable", "sandbox_unavailable", "nvml_unavailable", "train_root_missing", *LEDGER,
                 "launch_failed")
RESUME_ERRORS = ("job_not_found", "job_gone", "validation_failed", "not_resumable", "idempotency_key_reused",
                 "dataset_invalid", "job_active", "insufficient_vram", "gpu_busy", "gpu_locked", "insufficient_disk",
                 "trainer_unavailable", "sandbox_unavailable", "nvml_unavailable", *LEDGER, "launch_failed")
JOB_READ_ERRORS = ("job_not_found", "job_gone", "validation_failed", *LEDGER)
PNG = "image/png"
PNG_BODY = {"type": "string", "format": "binary"}

DOCS: dict[str, Doc] = {
    "train.submit": Doc("Start a training job: validated, admitted, recorded, launched. With `dry_run=1`, every "
                        "check and no start: the plan.", 202, AcceptedSchema,
                        errors=SUBMIT_ERRORS, body=TrainRequestSchema, parameters=(IDEMPOTENCY_KEY,),
                        query=SubmitQuerySchema,
                        also={200: "An Idempotency-Key seen before, with the same body: the original job (the "
                                   "202's shape); or, with `dry_run=1`, the plan (docs/jobs.md, Dry run)."},
                        also_schema={"oneOf": [AcceptedSchema, PlanSchema]}),
    "train.list_jobs": Doc("Recent jobs, newest first; `next_before_id` pages back.", 200, JobListSchema,
                           errors=("validation_failed", *LEDGER), query=JobListQuerySchema),
    "train.status": Doc("One job: state, phase, progress, outcome; with `since`, a long poll.", 200, JobSchema,
                        errors=JOB_READ_ERRORS, query=StatusQuerySchema,
                        headers={"Retry-After": {
                            "description": "Only on a long poll that found every slot taken, answered at once: "
                                           "seconds to wait before polling again",
                            "schema": {"type": "integer", "minimum": 1}}}),
    "train.progress": Doc("The loss curve: (step, loss, t) thinned to at most `points`.", 200, ProgressSeriesSchema,
                          errors=JOB_READ_ERRORS, query=ProgressQuerySchema),
    "train.job_log": Doc("A job's run log: its last lines, or from a logical byte offset.", 200, LogSchema,
                         errors=(*JOB_READ_ERRORS, "log_unreadable"), query=LogQuerySchema),
    "train.cancel": Doc("Ask a job to stop; harmless twice, 409 `job_finished` once it ended. With `wait`, answer "
                        "once it has ended (200), or after that many seconds with its state then (202). "
                        + CANCEL_RULE, 202, CancelAnswerSchema,
                        errors=("job_not_found", "job_gone", "job_finished", "validation_failed", *LEDGER),
                        query=CancelQuerySchema,
                        also={200: "With `wait`: the job ended within it (`cancelled`; or, when its trainer had "
                                   "ended before the cancel reached it, the outcome it had)."}),
    "train.resume_verdict": Doc("Whether the ended job can be resumed, from which saved state, and why each newer "
                                "state (or the job) was refused: docs/resume.md.", 200, ResumeVerdictSchema,
                                errors=JOB_READ_ERRORS),
    "train.resume": Doc("Resume the ended job from its newest state that passes every check: a new job, linked "
                        "by `resumed_from` and `attempt`, admitted and launched as POST /train's are.", 202,
                        ResumeAcceptedSchema, errors=RESUME_ERRORS, parameters=(IDEMPOTENCY_KEY,),
                        also={200: "An Idempotency-Key seen before: the resume it started."}),
    "samples.samples": Doc("The job's sample images (and those of the jobs it resumed), by step then prompt, each "
                           "with its prompt, seed, size, bytes, sha256 and the verified step LoRA of its step: "
                           "docs/samples.md.", 200, SamplesSchema, errors=JOB_READ_ERRORS),
    "samples.sample_image": Doc("One sample image, as listed: read without following a link and served only while "
                                "its sha256 is the listed one.", 200, PNG_BODY, media_type=PNG,
                                errors=(*JOB_READ_ERRORS, "sample_not_found", "sample_gone")),
    "samples.contact_sheet": Doc("The contact sheet: steps as rows (at most 12), prompts as columns, thumbnails.",
                                 200, PNG_BODY, media_type=PNG, errors=(*JOB_READ_ERRORS, "sample_not_found")),
    "samples.promote": Doc("Make the verified step LoRA of `step` the succeeded job's result (`lora_path`, "
                           "`lora_sha256`, `promoted_step`, a `job.promoted` event), without training again; the "
                           "same step again changes nothing.", 200, PromotedSchema, body=PromoteSchema,
                           errors=("job_not_found", "job_gone", "bad_request", "validation_failed", "not_promotable",
                                   *LEDGER)),
    "deliveries.deliveries": Doc("The job's webhook events, oldest first, each with every attempt to deliver it "
                                 "(time, status code, latency, error).", 200, DeliveriesSchema,
                                 errors=JOB_READ_ERRORS),
    "deliveries.redeliver": Doc("Send one webhook event again, under its own `webhook-id`, next among the job's "
                                "events.", 202, DeliverySchema,
                                errors=("job_not_found", "event_not_found", "validation_failed", *LEDGER)),
    "gpu.gpu_status": Doc("Each GPU's memory, compute processes and interlock, in PCI bus order.", 200,
                          GpuStatusSchema, errors=("nvml_unavailable", *LEDGER)),
    "health.healthz": Doc("Liveness and the active job id; open without a token. It only reads: no reconcile, "
                          "no write, no signal. With `deep=1`, 200 only once the start-up's deep checks found "
                          "the host can train.", 200, HealthSchema, errors=("ledger_replaced", "host_not_ready")),
    "metrics.metrics": Doc("Prometheus metrics: jobs by state, durations, the active job, GPU memory.", 200,
                           {"type": "string"}, media_type=METRICS_MEDIA_TYPE),
    "openapi.openapi_document": Doc("This document.", 200, {"type": "object"}, errors=()),
}


WEBHOOKS: dict[str, Any] = {
    "description": "With `webhook_url` configured, the worker POSTs each job's events there (docs/webhooks.md), "
                   "signed by the Standard Webhooks spec: `webhook-id` (stable across attempts: drop repeats), "
                   "`webhook-timestamp` (Unix seconds of the attempt), `webhook-signature` (`v1,` + base64 "
                   "HMAC-SHA256 of `{id}.{timestamp}.{body}` with each active secret, space-separated). Verify "
                   "with any Standard Webhooks library. In order per job, at least once, retried with backoff "
                   "until webhook_give_up_s; a 2xx delivers, 410 gives up.",
    "events": list(WEBHOOK_EVENT_TYPES),
    "headers": ["webhook-id", "webhook-timestamp", "webhook-signature"],
    "body": {"type": "object", "required": ["type", "timestamp", "data"], "properties": {
        "type": {"type": "string", "enum": list(WEBHOOK_EVENT_TYPES)},
        "timestamp": {"type": "string", "format": "date-time"},
        "data": {"type": "object", "description": "the job as GET /train/<id> shows it when the event was "
                                                  "written (worker_job_id, status, phase, step, total_steps, "
                                                  "loss, lora_path, lora_sha256, failure_class, error, …), "
                                                  "plus `retryable`; `job.checkpoint` adds `checkpoint`, the "
                                                  "step LoRA whose verification it tells (step, path, bytes, "
                                                  "sha256, verified, error: a failed one is an event too); "
                                                  "`job.sample` adds `sample`, a pass over (step, expected, "
                                                  "images, lora: the step LoRA of its step); `job.promoted` adds "
                                                  "`promoted` (step, path, sha256, bytes)"}}},
}


@bp.get("/openapi.json")
def openapi_document() -> Response:
    # Built once per app: the routes and schemas do not change while it runs.
    document = current_app.extensions.get("lora_worker_openapi")
    if document is None:
        document = current_app.extensions["lora_worker_openapi"] = build_document(current_app)
    return jsonify(document)


def build_document(app: Flask) -> dict[str, Any]:
    # apispec is imported here, on the first request for the document, not in every worker that never serves it.
    from apispec import APISpec
    from apispec.ext.marshmallow import MarshmallowPlugin
    from apispec_webframeworks.flask import FlaskPlugin

    spec = APISpec(title="lora-worker", version=_package_version(), openapi_version=OPENAPI_VERSION,
                   plugins=[FlaskPlugin(), MarshmallowPlugin()],
                   info={"description": "Runs SDXL LoRA training on demand; see the README and docs/."},
                   security=[{"bearer": []}])
    spec.components.security_scheme("bearer", {"type": "http", "scheme": "bearer"})
    spec.components.schema("Error", schema=ErrorSchema)
    spec.components.schema("Finding", schema=FindingSchema)  # a job's `warnings` refer to it by name
    # Every error a client can meet and what to do about it; docs/errors.md's table says the same.
    spec.options["x-errors"] = [_entry(entry) for entry in CATALOGUE]
    # OpenAPI 3.0 has no `webhooks` (3.1 does): what the worker POSTs to `webhook_url` goes under x-webhooks.
    spec.options["x-webhooks"] = WEBHOOKS
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: (r.rule, r.endpoint)):
        doc = DOCS.get(rule.endpoint)
        if doc is None:
            continue  # undocumented: the coverage test names it
        operations = {method.lower(): _operation(rule, doc) for method in documented_methods(rule)}
        spec.path(view=app.view_functions[rule.endpoint], app=app, operations=operations)
    return spec.to_dict()


def documented_methods(rule: Rule) -> list[str]:
    """The methods a route really serves; Flask adds HEAD and OPTIONS to every rule by itself."""
    return sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})


def _operation(rule: Rule, doc: Doc) -> dict[str, Any]:
    responses: dict[int, Any] = {doc.status: {"description": doc.summary,
                                              "content": {doc.media_type: {"schema": doc.response}}}}
    if doc.headers:
        responses[doc.status]["headers"] = doc.headers
    for status, when in (doc.also or {}).items():
        responses[status] = {"description": when,
                             "content": {doc.media_type: {"schema": doc.also_schema or doc.response}}}
    responses.update(_error_responses(rule, doc))
    operation: dict[str, Any] = {"operationId": rule.endpoint, "summary": doc.summary, "responses": responses,
                                 "parameters": _path_parameters(rule)}
    if doc.query is not None:
        operation["parameters"].append({"in": "query", "schema": doc.query})
    operation["parameters"].extend(doc.parameters)
    if doc.body is not None:
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": doc.body}}}
    if rule.endpoint in OPEN_ENDPOINTS:
        operation["security"] = []
    return operation


def _error_responses(rule: Rule, doc: Doc) -> dict[int, Any]:
    """The operation's error responses, one per status, each naming its errors (401 on every guarded route)."""
    answers: dict[int, Any] = {}
    codes = doc.errors if rule.endpoint in OPEN_ENDPOINTS else ("unauthorized", *doc.errors)
    by_status: dict[int, list[ErrorEntry]] = {}
    for code in codes:
        by_status.setdefault(BY_CODE[code].status, []).append(BY_CODE[code])
    for status, entries in sorted(by_status.items()):
        answers[status] = {"description": " ".join(f"`{e.error}`: {e.advice}" for e in entries),
                           "content": {JSON: {"schema": ErrorSchema}},
                           "x-errors": [e.error for e in entries]}
        if any(e.retry_after for e in entries):
            answers[status]["headers"] = {"Retry-After": {
                "description": "Seconds to wait, where the wait is known", "schema": {"type": "integer"}}}
    if 401 in by_status:
        answers[401]["headers"] = {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}
    return answers


def _entry(entry: ErrorEntry) -> dict[str, Any]:
    return {"status": entry.status, "error": entry.error, "retryable": entry.retryable,
            "retry_after": entry.retry_after, "advice": entry.advice}


def _path_parameters(rule: Rule) -> list[dict[str, Any]]:
    return [{"in": "path", "name": m["name"], "required": True,
             "schema": PATH_PARAMETER_TYPES.get(m["converter"] or "", {"type": "string"})}
            for m in RULE_ARGUMENT.finditer(rule.rule)]


def _package_version() -> str:
    try:
        return version("lora-worker")
    except PackageNotFoundError:  # running from a bare checkout
        return "0"

"""One way from an exception to HTTP, and one JSON shape for every error: {error, message, status, retryable, …}.

`CATALOGUE` is every error a client can meet: its status, whether the same request may succeed later by
waiting alone (`retryable`), what `Retry-After` says, and what a client should do. The OpenAPI document and
docs/errors.md's table are both drawn from it (a test holds docs/errors.md to the document).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, jsonify
from marshmallow import ValidationError
from werkzeug.exceptions import HTTPException

from lora_worker import errors as domain
from lora_worker.errors import (Conflict, InsufficientStorage, InvalidRequest, JobFinished, JobGone, JobNotFound,
                                LoraWorkerError, NotPromotable, NotResumable, SampleGone, Unavailable)

log = logging.getLogger(__name__)

# Domain error family → HTTP status; the first match in MRO order wins. 409 is kept for "busy now, retry
# later" alone, so a client that retries every 409 never retries something that cannot change.
STATUS: dict[type[LoraWorkerError], int] = {
    InvalidRequest: 422,
    JobNotFound: 404,
    JobGone: 410,
    JobFinished: 409,
    NotResumable: 422,  # never by waiting: each of `details.reasons` needs something changed first
    NotPromotable: 422,
    SampleGone: 410,
    Conflict: 409,
    InsufficientStorage: 507,
    Unavailable: 503,
}


@dataclass(frozen=True)
class ErrorEntry:
    status: int
    error: str
    retryable: bool
    retry_after: str  # what the Retry-After header holds, in words; "" when the answer carries none
    advice: str  # what a client should do


# The errors the web layer raises itself (werkzeug's, ours around the routes, and the buffering worker's before
# a request reaches Flask), by their JSON `error`. Nothing is answered with a code that is not here.
_HTTP: tuple[ErrorEntry, ...] = (
    ErrorEntry(400, "bad_request", False, "", "Send a JSON body (the message says where the JSON is malformed)."),
    ErrorEntry(401, "unauthorized", False, "", "Send `Authorization: Bearer <token>` with the right token."),
    ErrorEntry(404, "not_found", False, "", "No such route: check the URL."),
    ErrorEntry(405, "method_not_allowed", False, "", "Use a method the `Allow` header names."),
    ErrorEntry(408, "request_timeout", True, "",
               "Send the request again, whole (headers and body within 10 seconds)."),
    ErrorEntry(411, "length_required", False, "", "Send the body with a Content-Length header, not chunked."),
    ErrorEntry(413, "request_entity_too_large", False, "", "Send a smaller body (64 KiB at most)."),
    ErrorEntry(500, "internal_error", False, "",
               "A bug in the worker: report it with the time; do not retry blindly."),
)

_ADVICE: dict[str, tuple[str, str]] = {  # domain code → (Retry-After in words, what a client should do)
    "validation_failed": ("", "Fix the fields `fields` names; the same request always fails."),
    "dataset_invalid": ("", "Fix the dataset folder (the message says what is wrong), then send again."),
    "base_model_invalid": ("", "Name a readable SDXL .safetensors checkpoint in an allowed models dir."),
    "idempotency_key_reused": ("", "Use a new Idempotency-Key for a different body."),
    "output_exists": ("", "Choose another `output_name`: a finished LoRA is never overwritten."),
    "job_not_found": ("", "Check the job id; pruned jobs are gone."),
    "event_not_found": ("", "Check the event id: `GET /train/<id>/deliveries` lists the job's events."),
    "sample_not_found": ("", "Check the name: `GET /train/<id>/samples` lists the job's images (none before its "
                             "first pass is over)."),
    "sample_gone": ("", "Do not retry: the file on disk changed since it was listed (someone removed or replaced "
                        "it); list the samples again."),
    "not_promotable": ("", "Do not retry: `details.reason` says why the step cannot be the result (docs/errors.md, "
                           "Promote refusals); list the job's samples for the steps that can."),
    "job_active": ("", "Retry later: one job trains at a time (`details.active_job_id` names it; poll it and "
                       "retry once it has ended). No Retry-After: when it ends is not known."),
    "job_gone": ("", "Nothing to wait for: the ledger lost the job (`details.log_path` is its run log); "
                     "send the request again for a new job if it is still wanted."),
    "train_root_missing": ("", "An operator must mount or create the train root (`lora-worker doctor`)."),
    "insufficient_vram": ("", "Retry later, when the device has freed memory, or choose another device."),
    "gpu_busy": ("", "Retry later, when the foreign processes (`details.processes`) have left the device."),
    "gpu_locked": ("", "Retry later: another trainer on the host holds the device's lock (see /gpu-status)."),
    "job_finished": ("", "Nothing to cancel: `details.status` is the job's final state."),
    "not_resumable": ("", "Do not retry the resume: `details.reasons` says why no state of the job can be used "
                          "(docs/errors.md, Resume refusals); send the request again for a new job."),
    "insufficient_disk": ("", "An operator must free space on the output volume; do not retry until then."),
    "trainer_unavailable": ("", "An operator must repair the trainer install (`lora-worker doctor`)."),
    "nvml_unavailable": ("", "An operator must restore the NVIDIA driver, or its process query on the device "
                             "(the message names the cause; `lora-worker doctor`)."),
    "ledger_busy": ("1", "Retry after `Retry-After` seconds."),
    "ledger_unwritable": ("10", "Retry after `Retry-After` seconds; an operator should check the state disk."),
    "launch_failed": ("", "Retry once; if it fails again an operator should read the worker's log."),
    "sandbox_unavailable": ("", "An operator must install bubblewrap (`apt-get install bubblewrap`; "
                                "`lora-worker doctor`)."),
    "host_not_ready": ("", "Deploy gate: wait while `details.deep.status` is pending; when failing, an operator "
                           "must fix what `details.deep.failed` names (`lora-worker doctor --strict`)."),
    "log_unreadable": ("", "Do not retry: an operator must look at the state dir's logs/ (the message names "
                           "what is there instead of the log); the job's state is unaffected."),
    "ledger_replaced": ("", "An operator must restart the service: the ledger file was deleted or replaced "
                            "under it (`/healthz` says `failing`)."),
}

# Errors that stop the service at start-up or name a family; none reaches a client.
_NOT_ANSWERED = {domain.LoraWorkerError, domain.ConfigError, domain.LedgerCorrupt, domain.Conflict,
                 domain.Unavailable, domain.InsufficientStorage}


def status_of(exc: LoraWorkerError | type[LoraWorkerError]) -> int:
    cls = exc if isinstance(exc, type) else type(exc)
    for base in cls.__mro__:
        if base in STATUS:
            return STATUS[base]
    return 500


def answered_errors() -> list[type[LoraWorkerError]]:
    """Every domain error class a client can receive."""
    found: list[type[LoraWorkerError]] = []
    pending = [LoraWorkerError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls not in _NOT_ANSWERED and cls.__module__ == domain.__name__:
            found.append(cls)
    return found


def _catalogue() -> tuple[ErrorEntry, ...]:
    entries = list(_HTTP)
    for cls in answered_errors():
        retry_after, advice = _ADVICE[cls.code]
        retry_after = retry_after or (f"{cls.retry_after_s:g}" if cls.retry_after_s else "")
        entries.append(ErrorEntry(status_of(cls), cls.code, cls.retryable, retry_after, advice))
    return tuple(sorted(entries, key=lambda e: (e.status, e.error)))


CATALOGUE: tuple[ErrorEntry, ...] = _catalogue()
BY_CODE: dict[str, ErrorEntry] = {entry.error: entry for entry in CATALOGUE}


def error_response(status: int, code: str, message: str, *, retryable: bool | None = None,
                   retry_after_s: float | None = None, **extra: Any) -> Response:
    if retryable is None:
        entry = BY_CODE.get(code)
        retryable = entry.retryable if entry is not None else False
    body = {"error": code, "message": message, "status": status, "retryable": retryable,
            **{k: v for k, v in extra.items() if v is not None}}
    response = jsonify(body)
    response.status_code = status
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))  # whole seconds (RFC 9110)
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(LoraWorkerError)
    def _domain(exc: LoraWorkerError) -> Response:
        details = {k: v for k, v in exc.details.items() if k != "fields"}
        return error_response(status_of(exc), exc.code, exc.message, retryable=exc.retryable,
                              retry_after_s=exc.retry_after_s if exc.retryable else None,
                              fields=exc.details.get("fields"), details=details or None)

    @app.errorhandler(ValidationError)
    def _invalid(exc: ValidationError) -> Response:
        fields = exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages}
        return _domain(InvalidRequest(_flatten(fields)))

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        status, code = http_code(exc)
        # werkzeug's own sentences are written for a browser ("The browser (or proxy) sent …"): the catalogue's
        # advice instead, unless the raise site wrote its own.
        own = exc.description is not None and exc.description != type(exc).description
        response = error_response(status, code, exc.description if own and exc.description else BY_CODE[code].advice)
        if exc.code == 405 and exc.valid_methods:  # type: ignore[attr-defined]
            response.headers["Allow"] = ", ".join(exc.valid_methods)  # type: ignore[attr-defined]
        return response

    @app.errorhandler(Exception)
    def _bug(exc: Exception) -> Response:
        log.exception("unhandled error")  # a 5xx is a bug: it goes to the log with its traceback
        return error_response(500, "internal_error", "The worker hit an internal error; see its log.")


def http_code(exc: HTTPException) -> tuple[int, str]:
    """The status and catalogued code of a werkzeug error: its own where the catalogue has it, else the
    family's (`bad_request` for a 4xx, `internal_error` for a 5xx), never a code outside the catalogue."""
    status = exc.code or 500
    code = (exc.name or "error").lower().replace(" ", "_")
    entry = BY_CODE.get(code)
    if entry is not None and entry.status == status:
        return status, code
    return (400, "bad_request") if 400 <= status < 500 else (500, "internal_error")


def _flatten(messages: dict[str, Any]) -> dict[str, list[str]]:
    flat: dict[str, list[str]] = {}
    for name, value in messages.items():
        if isinstance(value, dict):
            for sub, msgs in _flatten(value).items():
                flat[f"{name}.{sub}"] = msgs
        else:
            flat[str(name)] = [str(m) for m in (value if isinstance(value, list) else [value])]
    return flat

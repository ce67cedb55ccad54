"""One way from an exception to HTTP, and one JSON shape for every error: {error, message, status, …}."""
from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, jsonify
from marshmallow import ValidationError
from werkzeug.exceptions import HTTPException

from lora_worker.errors import (Conflict, InvalidRequest, JobNotFound, LedgerBusy, LedgerUnwritable,
                                LoraWorkerError, Unavailable)

log = logging.getLogger(__name__)

# Domain error family → HTTP status; the first match in MRO order wins.
STATUS: dict[type[LoraWorkerError], int] = {
    InvalidRequest: 422,
    JobNotFound: 404,
    Conflict: 409,
    Unavailable: 503,
}


def error_response(status: int, code: str, message: str, **extra: Any) -> Response:
    body = {"error": code, "message": message, "status": status, **{k: v for k, v in extra.items() if v is not None}}
    response = jsonify(body)
    response.status_code = status
    return response


def status_of(exc: LoraWorkerError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(LoraWorkerError)
    def _domain(exc: LoraWorkerError) -> Response:
        details = {k: v for k, v in exc.details.items() if k != "fields"}
        response = error_response(status_of(exc), exc.code, exc.message,
                                  fields=exc.details.get("fields"), details=details or None)
        if isinstance(exc, (LedgerBusy, LedgerUnwritable)):
            response.headers["Retry-After"] = "1" if isinstance(exc, LedgerBusy) else "10"
        return response

    @app.errorhandler(ValidationError)
    def _invalid(exc: ValidationError) -> Response:
        fields = exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages}
        return _domain(InvalidRequest(_flatten(fields)))

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        code = (exc.name or "error").lower().replace(" ", "_")
        response = error_response(exc.code or 500, code, exc.description or exc.name)
        if exc.code == 405 and exc.valid_methods:  # type: ignore[attr-defined]
            response.headers["Allow"] = ", ".join(exc.valid_methods)  # type: ignore[attr-defined]
        return response

    @app.errorhandler(Exception)
    def _bug(exc: Exception) -> Response:
        log.exception("unhandled error")  # a 5xx is a bug: it goes to the log with its traceback
        return error_response(500, "internal_error", "The worker hit an internal error; see its log.")


def _flatten(messages: dict[str, Any]) -> dict[str, list[str]]:
    flat: dict[str, list[str]] = {}
    for name, value in messages.items():
        if isinstance(value, dict):
            for sub, msgs in _flatten(value).items():
                flat[f"{name}.{sub}"] = msgs
        else:
            flat[str(name)] = [str(m) for m in (value if isinstance(value, list) else [value])]
    return flat

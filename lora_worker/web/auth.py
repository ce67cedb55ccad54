"""Bearer-token auth for every route but /healthz, and the start-up rule that keeps a tokenless worker on loopback.

The token is read from a file: the systemd credential `$CREDENTIALS_DIRECTORY/api_token` (LoadCredential=), else
the `api_token_file` setting. It is compared as bytes with `hmac.compare_digest`, and never logged, echoed or
handed on: the trainer's environment is an allow-list, and only the file's path is a setting.
"""
from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from flask import Flask, Response, request

from lora_worker.web.errors import error_response
from lora_worker.config import Settings
from lora_worker.host.bind import is_loopback
from lora_worker.errors import ConfigError

log = logging.getLogger(__name__)

CREDENTIAL = "api_token"  # the name in the unit's LoadCredential=api_token:/etc/lora-worker/api_token
MIN_TOKEN_BYTES = 32
OPEN_ENDPOINTS = frozenset({"health.healthz"})  # liveness only, no job data


def token_file(settings: Settings, environ: Mapping[str, str]) -> Path | None:
    """Where the token lives: the systemd credential if the unit passed one, else the configured file."""
    credentials = environ.get("CREDENTIALS_DIRECTORY")
    if credentials and (Path(credentials) / CREDENTIAL).is_file():
        return Path(credentials) / CREDENTIAL
    return settings.api_token_file


def load_token(settings: Settings, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The token as bytes, or None when none is configured. A configured but unusable one stops the service."""
    path = token_file(settings, os.environ if environ is None else environ)
    if path is None:
        return None
    try:
        token = path.read_bytes().strip()  # a trailing newline from `echo … > file` is not part of it
    except OSError as exc:
        raise ConfigError(f"cannot read the API token file {path}: {exc.strerror or exc}") from exc
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"the API token in {path} is {len(token)} bytes; at least {MIN_TOKEN_BYTES} are required "
                          "(make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def require_token_off_loopback(settings: Settings, token: bytes | None) -> None:
    """Without a token the worker is a development server: refuse it anywhere but loopback."""
    if token is None and not is_loopback(settings.bind):
        raise ConfigError(f"no API token is configured and the worker listens on {settings.bind!r}, which is not "
                          "loopback only; configure a token (LoadCredential=api_token:… or api_token_file) "
                          "or bind to 127.0.0.1")
    if token is None:
        log.warning("no API token: serving without auth on %s (development mode, loopback only)", settings.bind)


def protect(app: Flask, token: bytes | None) -> None:
    """Require `Authorization: Bearer <token>` on every route but the open ones (no-op without a token)."""
    if token is None:
        return

    @app.before_request
    def _require_token() -> Response | None:
        # Runs before routing errors are raised, so an unknown path without a token is a 401 too.
        if request.endpoint in OPEN_ENDPOINTS:
            return None
        credentials = request.authorization
        offered = credentials.token if credentials is not None and credentials.type == "bearer" else None
        if not offered:
            return _unauthorized("This route needs an 'Authorization: Bearer <token>' header.", None)
        if not hmac.compare_digest(offered.encode("utf-8", "surrogateescape"), token):
            return _unauthorized("The bearer token is not valid.", "invalid_token")
        return None


def _unauthorized(message: str, error: str | None) -> Response:
    response = error_response(401, "unauthorized", message)
    # RFC 6750 §3: name the scheme; say `invalid_token` only when a token was offered.
    response.headers["WWW-Authenticate"] = 'Bearer realm="lora-worker"' + (f', error="{error}"' if error else "")
    return response

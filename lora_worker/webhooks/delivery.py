"""One delivery attempt: a POST of the event's body to the configured URL, and what came of it.

http.client, because it does exactly what the sender needs and nothing more: it never follows a redirect (a
3xx is an answer, recorded and retried like any failure, never a new target), it takes a timeout for the
connection and another for the answer, and the answer's body is read only up to `MAX_ANSWER_BYTES`. An https
URL gets the default SSL context: the certificate and the host name are checked against the system's CAs.
"""
from __future__ import annotations

import http.client
import socket
import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

MAX_ANSWER_BYTES = 64 * 1024
USER_AGENT = "lora-worker-webhooks/1"


@dataclass(frozen=True)
class Answer:
    """What one attempt got: an HTTP status, or an error before any (`status` None)."""

    status: int | None
    latency_ms: float
    error: str | None = None
    retry_after_s: float | None = None

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def post(url: str, body: bytes, headers: dict[str, str], *, connect_timeout_s: float,
         read_timeout_s: float) -> Answer:
    started = time.monotonic()
    target = urlsplit(url)
    path = (target.path or "/") + (f"?{target.query}" if target.query else "")
    conn = _connection(target.scheme, target.hostname or "", target.port, connect_timeout_s)
    try:
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(read_timeout_s)
        conn.request("POST", path, body=body, headers={
            **headers, "content-type": "application/json", "user-agent": USER_AGENT})
        response = conn.getresponse()
        answer = response.read(MAX_ANSWER_BYTES)
        return Answer(response.status, _ms(started), _error_of(response.status, answer),
                      retry_after_s(response.getheader("Retry-After")))
    except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
        return Answer(None, _ms(started), _describe(exc))
    finally:
        conn.close()


def _connection(scheme: str, host: str, port: int | None, timeout_s: float) -> http.client.HTTPConnection:
    if scheme == "https":
        return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=ssl.create_default_context())
    return http.client.HTTPConnection(host, port, timeout=timeout_s)


def _ms(started: float) -> float:
    return (time.monotonic() - started) * 1000.0


def _error_of(status: int, answer: bytes) -> str | None:
    if 200 <= status < 300:
        return None
    if 300 <= status < 400:
        return f"HTTP {status}: a redirect, which is never followed (set webhook_url to where it points)"
    text = answer[:200].decode("utf-8", "replace").strip()
    return f"HTTP {status}" + (f": {text}" if text else "")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def retry_after_s(value: str | None, now: datetime | None = None) -> float | None:
    """Retry-After as seconds from now: delay-seconds or an HTTP date (RFC 9110 §10.2.3); None if absent or
    unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())

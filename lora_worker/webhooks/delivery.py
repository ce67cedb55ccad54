"""One delivery attempt: a POST of the event's body to the configured URL, and what came of it.

http.client, because it does exactly what the sender needs and nothing more: it never follows a redirect (a
3xx is an answer, recorded and retried like any failure, never a new target), and the answer's body is read
only up to `MAX_ANSWER_BYTES`. An https URL gets the default SSL context: the certificate and the host name
are checked against the system's CAs.

One deadline bounds the whole attempt: the connection (at most `connect_timeout_s` of it), the TLS handshake,
the request and the whole answer, `connect_timeout_s + read_timeout_s` in all (`attempt_deadline_s`).
http.client's own timeout bounds each socket operation, not their sum: a receiver that drips its answer a byte
at a time would hold the attempt for as long as it liked. Here each operation is given only the time the
attempt has left (`_Bounded`). Name resolution is the system resolver's (no receiver answers it).

Everything read here comes from the receiver, so nothing it sends may raise out of `post`: whatever the bytes,
the result is an Answer (`exchange`), Retry-After included (`retry_after_s`).
"""
from __future__ import annotations

import http.client
import io
import math
import socket
import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import cast
from urllib.parse import SplitResult, urlsplit

MAX_ANSWER_BYTES = 64 * 1024
MAX_ERROR_CHARS = 200  # what of an error (often the receiver's own words) the outbox keeps
# The longest wait a receiver's Retry-After may ask for: the sender's longest backoff. Longer counts as this.
MAX_RETRY_AFTER_S = 3600.0
USER_AGENT = "lora-worker-webhooks/1"
_FAILURES = (OSError, http.client.HTTPException, ssl.SSLError, ValueError)


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


def attempt_deadline_s(connect_timeout_s: float, read_timeout_s: float) -> float:
    return connect_timeout_s + read_timeout_s


def post(url: str, body: bytes, headers: dict[str, str], *, connect_timeout_s: float,
         read_timeout_s: float) -> Answer:
    started = time.monotonic()
    deadline = started + attempt_deadline_s(connect_timeout_s, read_timeout_s)
    target = urlsplit(url)
    try:
        sock = _connect(target, connect_timeout_s, deadline)
    except _FAILURES as exc:
        return Answer(None, _ms(started), _describe(exc))
    try:
        path = (target.path or "/") + (f"?{target.query}" if target.query else "")
        return exchange(sock, target.hostname or "", target.port, path, body, headers, deadline, started)
    finally:
        sock.close()


def _connect(target: SplitResult, connect_timeout_s: float, deadline: float) -> socket.socket:
    port = target.port or (443 if target.scheme == "https" else 80)
    sock = socket.create_connection((target.hostname or "", port), timeout=min(connect_timeout_s, _left(deadline)))
    if target.scheme != "https":
        return sock
    try:
        sock.settimeout(_left(deadline))  # CPython bounds the whole handshake by the socket's timeout
        return ssl.create_default_context().wrap_socket(sock, server_hostname=target.hostname)
    except BaseException:
        sock.close()
        raise


def exchange(sock: socket.socket, host: str, port: int | None, path: str, body: bytes, headers: dict[str, str],
             deadline: float, started: float) -> Answer:
    """Send the request on a connected `sock` and read the answer, all by `deadline`: an Answer, whatever the
    receiver sends (it raises nothing)."""
    try:
        conn = http.client.HTTPConnection(host, port)  # it never connects itself: the socket is ours
        conn.sock = cast(socket.socket, _Bounded(sock, deadline))  # what it calls: sendall, makefile, close
        conn.request("POST", path, body=body, headers={
            **headers, "content-type": "application/json", "user-agent": USER_AGENT, "connection": "close"})
        response = conn.getresponse()
        answer = response.read(MAX_ANSWER_BYTES)
        return Answer(response.status, _ms(started), _error_of(response.status, answer),
                      retry_after_s(response.getheader("Retry-After")))
    except _FAILURES as exc:
        return Answer(None, _ms(started), _describe(exc))


class _Bounded:
    """The socket as http.client uses it, every send and receive given only the time the attempt has left."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        self.sock.settimeout(_left(self.deadline))  # sendall's timeout is for the whole call (Python ≥ 3.5)
        self.sock.sendall(data)

    def recv_into(self, buffer: memoryview) -> int:
        self.sock.settimeout(_left(self.deadline))
        return self.sock.recv_into(buffer)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_Stream(self))

    def close(self) -> None:
        pass  # post() closes the real socket


class _Stream(io.RawIOBase):
    def __init__(self, source: _Bounded) -> None:
        self.source = source

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        return self.source.recv_into(buffer)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _ms(started: float) -> float:
    return (time.monotonic() - started) * 1000.0


def _error_of(status: int, answer: bytes) -> str | None:
    if 200 <= status < 300:
        return None
    if 300 <= status < 400:
        return f"HTTP {status}: a redirect, which is never followed (set webhook_url to where it points)"
    text = answer[:MAX_ERROR_CHARS].decode("utf-8", "replace").strip()
    return (f"HTTP {status}" + (f": {text}" if text else ""))[:MAX_ERROR_CHARS]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


def retry_after_s(value: str | None, now: datetime | None = None) -> float | None:
    """Retry-After as seconds from now, at most `MAX_RETRY_AFTER_S`: delay-seconds (ASCII digits only) or an HTTP
    date (RFC 9110 §10.2.3). None if absent or unreadable: a value that does not parse counts as absent."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        digits = value.lstrip("0")
        # More digits than any clamp needs: int() of a 5,000-digit string raises, and a timedelta overflows.
        return MAX_RETRY_AFTER_S if len(digits) > 9 else min(float(digits or 0), MAX_RETRY_AFTER_S)
    try:
        when = parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds)) if math.isfinite(seconds) else None

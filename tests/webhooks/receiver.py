"""A real HTTP receiver for the webhook tests: a small threaded server on loopback that records every request
and answers as its script says (a status per request, then 200), verified with the `standardwebhooks` package
as any receiver that follows the spec would."""
from __future__ import annotations

import base64
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from standardwebhooks.webhooks import Webhook


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def write_secrets(path: Path, *values: str) -> Path:
    path.write_text("\n".join(values) + "\n")
    path.chmod(0o600)
    return path


@dataclass
class Delivery:
    """One request as the receiver got it."""

    headers: dict[str, str]
    body: bytes
    at: float

    @property
    def event_id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def event(self) -> dict[str, Any]:
        return json.loads(self.body)

    def verified(self, secret: str) -> dict[str, Any]:
        """The body, once `standardwebhooks` accepts the signature (it raises otherwise)."""
        return Webhook(secret).verify(self.body, self.headers)


@dataclass
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    hold: threading.Event | None = None  # answer only once this is set (a request caught in flight)
    # Only a request about this job gets this answer: attempts for different jobs run at once, so which of them
    # reaches the receiver first is the scheduler's choice (under load, job B's once took job A's hold).
    job_id: int | None = None


class Receiver:
    """`script` answers the first requests in order; every later one gets 200."""

    def __init__(self, port: int = 0) -> None:
        self.deliveries: list[Delivery] = []
        self.script: list[Answer] = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                answer = receiver._next(Delivery({k.lower(): v for k, v in self.headers.items()}, body,
                                                 time.monotonic()))
                if answer.hold is not None:
                    answer.hold.wait(30)
                self.send_response(answer.status)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/arbo"

    def start(self) -> Receiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next(self, delivery: Delivery) -> Answer:
        with self.arrived:
            self.deliveries.append(delivery)
            answer = self._scripted(delivery)
            self.arrived.notify_all()
        return answer

    def _scripted(self, delivery: Delivery) -> Answer:
        job_id = delivery.event.get("data", {}).get("worker_job_id")
        for i, answer in enumerate(self.script):
            if answer.job_id in (None, job_id):
                return self.script.pop(i)
        return Answer()

    def wait_for(self, predicate: Callable[[list[Delivery]], bool], timeout: float = 20.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while not predicate(self.deliveries):
                left = deadline - time.monotonic()
                if left <= 0:
                    types = [d.event["type"] for d in self.deliveries]
                    raise AssertionError(f"the receiver did not get what was awaited; it got {types}")
                self.arrived.wait(left)
            return list(self.deliveries)

    def types(self) -> list[str]:
        return [d.event["type"] for d in self.deliveries]


def delivered_once_each(deliveries: list[Delivery]) -> list[Delivery]:
    """The deliveries without repeats of an id (what a receiver that drops duplicates keeps), in order."""
    seen: set[str] = set()
    kept = []
    for delivery in deliveries:
        if delivery.event_id not in seen:
            seen.add(delivery.event_id)
            kept.append(delivery)
    return kept

"""The demo's webhook receiver: a small HTTP server in the demo's own process, so that a newcomer sees each
event of the job arrive as arbo would, signature checked, while the job runs.

It checks each request as the Standard Webhooks spec says a receiver must (the signature over
`id.timestamp.body` with the secret, the timestamp within five minutes, each id once), with the standard
library: the same check any spec library makes.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOLERANCE_S = 300


def write_secret(path: Path) -> bytes:
    """A new secret, as the worker reads it (`whsec_<base64>`, mode 0600); its key bytes."""
    key = secrets.token_bytes(32)
    path.write_text("whsec_" + base64.b64encode(key).decode() + "\n")
    path.chmod(0o600)
    return key


def verified(key: bytes, headers: dict[str, str], body: bytes) -> bool:
    event_id, stamp = headers.get("webhook-id", ""), headers.get("webhook-timestamp", "")
    if not event_id or not stamp.isdigit() or abs(time.time() - int(stamp)) > TOLERANCE_S:
        return False
    mac = base64.b64encode(hmac.new(key, f"{event_id}.{stamp}.".encode() + body, hashlib.sha256).digest()).decode()
    offered = [s.split(",", 1)[1] for s in headers.get("webhook-signature", "").split() if s.startswith("v1,")]
    return any(hmac.compare_digest(mac, s) for s in offered)


def describe(event: dict[str, object]) -> str:
    data = event.get("data")
    data = data if isinstance(data, dict) else {}
    kind = str(event.get("type"))
    if kind == "job.phase":
        return f"{kind} → {data.get('phase')}"
    if kind == "job.progress":
        return f"{kind} step {data.get('step')}/{data.get('total_steps')}, loss {data.get('loss')}"
    if kind == "job.checkpoint" and isinstance(checkpoint := data.get("checkpoint"), dict):
        verdict = "verified" if checkpoint.get("verified") else f"NOT verified: {checkpoint.get('error')}"
        return f"{kind} step {checkpoint.get('step')} {verdict}: {checkpoint.get('path')}"
    if kind == "job.succeeded":
        return f"{kind}: {data.get('lora_path')}"
    if kind == "job.failed":
        return f"{kind}: {data.get('failure_class')}"
    return kind


@contextmanager
def receiver(key: bytes, say: Callable[[str], None]) -> Iterator[str]:
    """Serve on a free loopback port while the block runs; its URL."""
    seen: set[str] = set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", "0") or 0))
            headers = {k.lower(): v for k, v in self.headers.items()}
            ok = verified(key, headers, body)
            self.send_response(204 if ok else 401)
            self.send_header("content-length", "0")
            self.end_headers()
            repeat = headers.get("webhook-id", "") in seen
            seen.add(headers.get("webhook-id", ""))
            say(f"webhook ← {describe(json.loads(body)) if ok else 'REFUSED: the signature does not verify'}"
                + (" (a repeat: dropped)" if repeat else "") + (" (signature verified)" if ok else ""))

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/webhooks"
    finally:
        server.shutdown()
        server.server_close()

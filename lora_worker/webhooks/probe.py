"""What `lora-worker doctor` asks of the webhook target: the secret loads, and the URL answers HTTP.

The probe is an OPTIONS request, never an event: a receiver must not be handed a delivery nobody wrote. Any
HTTP answer, whatever its status, shows the target is there; a refused, unresolvable or silent one is what
would leave every event retrying until its give-up age.
"""
from __future__ import annotations

import http.client
import ssl
from urllib.parse import urlsplit

from lora_worker.config import Settings
from lora_worker.errors import ConfigError
from lora_worker.webhooks import delivery
from lora_worker.webhooks.signing import load_secrets


def webhook_findings(settings: Settings) -> list[tuple[str, bool, str]]:
    """(name, ok, detail) for each check; none without a target."""
    if not settings.webhook_url:
        return []
    try:
        keys = load_secrets(settings)
        secret = (True, f"{len(keys)} active secret(s)")
    except ConfigError as exc:
        secret = (False, str(exc))
    return [("webhook secret", *secret), ("webhook target", *answers(settings))]


def answers(settings: Settings) -> tuple[bool, str]:
    target = urlsplit(settings.webhook_url or "")
    conn: http.client.HTTPConnection
    if target.scheme == "https":
        conn = http.client.HTTPSConnection(target.hostname or "", target.port,
                                           timeout=settings.webhook_connect_timeout_s,
                                           context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(target.hostname or "", target.port,
                                          timeout=settings.webhook_connect_timeout_s)
    try:
        conn.request("OPTIONS", target.path or "/", headers={"user-agent": delivery.USER_AGENT})
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        return False, (f"{settings.webhook_url} does not answer ({type(exc).__name__}: {exc}); events wait in the "
                       "outbox until it does (GET /train/<id>/deliveries)")
    finally:
        conn.close()
    return True, f"{settings.webhook_url} answers (HTTP {status} to OPTIONS)"

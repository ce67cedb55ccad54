"""Whether a gunicorn bind is loopback only: the web refuses to serve beyond it without a token, and `lora-worker
config` (what `make run` runs first) refuses the same bind in one line before gunicorn starts."""
from __future__ import annotations

import ipaddress


def is_loopback(bind: str) -> bool:
    """Whether every address of a gunicorn bind (`host:port`, `[v6]:port`, `unix:path`, comma-separated) is
    reachable from this host only. Anything unrecognised counts as open."""
    addresses = [a.strip() for a in bind.split(",") if a.strip()]
    return bool(addresses) and all(_is_loopback_address(a) for a in addresses)


def _is_loopback_address(address: str) -> bool:
    if address.startswith("unix:"):
        return True  # a socket file cannot be reached from another host
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or gunicorn's "fd://": we cannot tell, so it is not loopback

"""deploy/requirements.lock read as data: every pin with its hashes."""
from __future__ import annotations

import re

from lora_worker.config import REPO_ROOT

LOCK = REPO_ROOT / "deploy" / "requirements.lock"


ENTRY = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries() -> dict[str, tuple[str, list[str]]]:
    """name → (version, its sha256 hashes)."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in LOCK.read_text().splitlines():
        if match := ENTRY.match(line):
            current = canonical(match["name"])
            entries[current] = (match["version"], [])
        elif current and (digest := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            entries[current][1].append(digest[1])
    return entries


def locked_pins() -> dict[str, str]:
    return {name: version for name, (version, _) in lock_entries().items()}


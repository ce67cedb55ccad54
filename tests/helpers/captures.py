"""The real sd-scripts captures of tests/data, as the supervisor's pipe gives them."""
from __future__ import annotations

import base64
import json

from tests.helpers import DATA

CAPTURES = sorted(p.stem for p in DATA.glob("*.jsonl"))


def stream(name: str) -> bytes:
    """A capture's bytes as the supervisor's one pipe gives them: every chunk, in arrival order."""
    lines = (DATA / f"{name}.jsonl").read_text().splitlines()[1:]
    return b"".join(base64.b64decode(json.loads(line)["b64"]) for line in lines)

"""lora-worker: runs SDXL LoRA training (kohya-ss sd-scripts) on demand, supervised and ledgered.

`create_app` is the gunicorn target (through `lora_worker.wsgi`). Flask is imported only when an app is
built, so the supervisor process, which imports this package, never loads it.
"""
from __future__ import annotations

# Not `typing.TYPE_CHECKING`: every process imports this package first, and a supervisor takes its job lock
# before it imports anything it need not (run/__main__.py); type checkers treat this name the same way.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from flask import Flask


def create_app(config: Any = None, **overrides: Any) -> Flask:
    from lora_worker.web.app import build_app

    return build_app(config, **overrides)

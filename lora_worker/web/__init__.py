"""HTTP: blueprints for the contract routes; thin views over `lora_worker.web.service.Worker`."""
from __future__ import annotations

from flask import current_app

from lora_worker.web.service import Worker


def worker() -> Worker:
    return current_app.extensions["lora_worker"]

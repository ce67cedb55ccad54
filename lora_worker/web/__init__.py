"""HTTP: blueprints for the contract routes; thin views over `lora_worker.web.service.Worker`."""
from __future__ import annotations

from typing import cast

from flask import current_app

from lora_worker.web.service import Worker


def worker() -> Worker:
    return cast(Worker, current_app.extensions["lora_worker"])  # create_app put it there

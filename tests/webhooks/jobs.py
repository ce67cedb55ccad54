"""Jobs with a webhook subscription, written straight to the ledger, and what their outbox holds."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from tests.helpers.ledger import columns

ALL = outbox.Subscription(frozenset(outbox.EVENT_TYPES), progress_interval_s=0.5)


def subscribed(**overrides: Any) -> dict[str, Any]:
    return columns(webhook_events=ALL.to_json(), **overrides)


def a_finished_job(db, **subscription: Any) -> int:
    """queued → running → succeeded: three events."""
    sub = replace(ALL, **subscription) if subscription else ALL
    job = repo.create_job(db, columns(webhook_events=sub.to_json()))
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", phase="training")
    repo.transition(db, job.id, JobState.SUCCEEDED, actor="supervisor", lora_path="/o/x.safetensors")
    return job.id


def events(db, job_id: int = 1) -> list[tuple[str, dict[str, Any]]]:
    with db.reading() as d:
        return [(json.loads(body)["type"], json.loads(body)["data"]) for _, body in outbox.bodies(d, job_id)]


def states(db, job_id: int) -> list[str]:
    with db.reading() as d:
        return [e["state"] for e in outbox.deliveries(d, job_id)]


def deliver_all(db) -> None:
    """What a sender does with a receiver that takes everything: each job's head, until none is due."""
    while True:
        with db.writing() as d:
            heads = outbox.due(d)
            for e in heads:
                outbox.begin_attempt(d, e.pk)
                outbox.delivered(d, e.pk)
        if not heads:
            return

"""Jobs with a webhook subscription, written straight to the ledger, and what their outbox holds; a sender run
in the test's own process."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from lora_worker.webhooks import signing
from lora_worker.webhooks.sender import Sender
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


def sender_for(settings, db, *, keys=None, rng=lambda: 0.0) -> Sender:
    return Sender(settings, db, keys or signing.load_secrets(settings), rng=rng)


def run_until(sender: Sender, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the sender did not get there in time"
        if sender.cycle() == 0:
            time.sleep(0.02)

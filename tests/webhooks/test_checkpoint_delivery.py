"""`job.checkpoint` with real processes: the web, the job's detached supervisor running the fake trainer (tier fast:
400 steps, a step LoRA every 100, the older pruned: no samples), the sender and a receiver on loopback. Each step
LoRA the ledger saw verified arrives once, signed, with what GET /train/<id> lists of it."""
from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from lora_worker import create_app
from tests.helpers import set_modes
from tests.webhooks.receiver import Delivery

pytestmark = pytest.mark.slow
TERMINAL_TYPES = ("job.succeeded", "job.failed", "job.cancelled")


@pytest.fixture
def client(hooked):
    app = create_app(hooked)  # starts the sender: webhook_url is set
    yield app.test_client()
    app.extensions["lora_worker"].db.dispose()


def ended(deliveries: list[Delivery]) -> bool:
    return any(d.event["type"] in TERMINAL_TYPES for d in deliveries)


def lora_rows(settings, job_id: int) -> dict[int, tuple]:
    conn = sqlite3.connect(settings.database_path)
    try:
        return {r[0]: r[1:] for r in conn.execute(
            "SELECT step, path, bytes, sha256, verified, error FROM checkpoints WHERE job_id = ? AND kind = 'lora'",
            (job_id,))}
    finally:
        conn.close()


def run_job(client, host, receiver, secret) -> tuple[int, list[dict], dict]:
    """Submit, wait for the ending to arrive; (job id, every body as verified, in order; GET's answer)."""
    answer = client.post("/train", json=host.payload(samples=[]))  # one step LoRA kept
    assert answer.status_code == 202, answer.get_json()
    job_id = answer.get_json()["worker_job_id"]
    got = receiver.wait_for(ended, timeout=90)
    assert len({d.event_id for d in got}) == len(got)  # nothing twice
    return job_id, [d.verified(secret) for d in got], client.get(f"/train/{job_id}").get_json()


def checkpoint_events_by_step(bodies: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for body in bodies:
        if body["type"] == "job.checkpoint":
            steps.setdefault(body["data"]["checkpoint"]["step"], []).append(body["data"])
    return steps


def test_each_verified_step_lora_arrives_once_with_its_row(client, hooked, host, receiver, secret):
    job_id, bodies, shown = run_job(client, host, receiver, secret)
    assert shown["status"] == "succeeded", shown
    rows = lora_rows(hooked, job_id)
    assert set(rows) == {100, 200, 300, 400}  # kept (400) or pruned (the others) by the trainer
    sent = checkpoint_events_by_step(bodies)
    # exactly one per step LoRA whose verification the ledger recorded (the older too, unless the trainer pruned
    # it before the worker saw a redraw after its save), each the row as recorded
    assert set(sent) == {step for step, row in rows.items() if row[3] is not None} and 400 in sent
    for step, [data] in sent.items():
        path, size, sha, verified, error = rows[step]
        assert data["checkpoint"] == {"step": step, "path": path, "bytes": size, "sha256": sha,
                                      "verified": bool(verified), "error": error}
        assert data["worker_job_id"] == job_id and data["status"] == "running"
    kept = Path(shown["checkpoints"][0]["path"])
    assert sent[400][0]["checkpoint"] == {**shown["checkpoints"][0], "verified": True}
    assert sent[400][0]["checkpoint"]["sha256"] == hashlib.sha256(kept.read_bytes()).hexdigest()
    types = [b["type"] for b in bodies]
    assert types.index("job.checkpoint") > types.index("job.started") and types[-1] == "job.succeeded"


def test_a_step_lora_that_fails_verification_arrives_once_with_its_error(client, hooked, host, receiver, secret):
    set_modes(host.sd_scripts, step_metadata_overrides={"ss_steps": "7"})  # each step LoRA says the wrong step
    _, bodies, shown = run_job(client, host, receiver, secret)
    assert shown["status"] == "succeeded", shown  # a step LoRA is never the job's result
    sent = checkpoint_events_by_step(bodies)
    assert 300 in sent and all(len(events) == 1 for events in sent.values())
    [data] = sent[300]
    assert (data["checkpoint"]["verified"], data["checkpoint"]["sha256"], data["checkpoint"]["error"]) == (
        False, None, "ss_steps '7' instead of 300")

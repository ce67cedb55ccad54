"""Idempotent dispatch: a retried POST with the same Idempotency-Key returns the original job."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest

from lora_worker import create_app
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from tests.helpers import job_rows as rows, set_modes, wait_for
from tests.helpers.service import Service


def post(client, body, key: str | None = "order-7f3a") -> tuple[int, dict]:
    headers = {"Idempotency-Key": key} if key else {}
    response = client.post("/train", data=body if isinstance(body, str) else json.dumps(body),
                           content_type="application/json", headers=headers)
    return response.status_code, response.get_json()


def test_the_same_key_and_body_return_the_original_job(api, host, launches):
    first = post(api, host.payload())
    again = post(api, host.payload())
    assert first[0] == 202 and again[0] == 200
    assert first[1]["worker_job_id"] == again[1]["worker_job_id"]
    assert rows(host.settings) == 1 and launches == [first[1]["worker_job_id"]]


def test_the_body_is_compared_as_json_not_as_bytes(api, host):
    body = host.payload()
    _, first = post(api, body)
    reordered = json.dumps(dict(reversed(list(body.items()))), indent=2)
    code, again = post(api, reordered)
    assert code == 200 and again["worker_job_id"] == first["worker_job_id"]


def test_the_same_key_with_another_body_is_a_422(api, host, launches):
    _, first = post(api, host.payload())
    code, body = post(api, host.payload(seed=7))
    assert code == 422 and body["error"] == "idempotency_key_reused"
    assert "Idempotency-Key" in body["fields"] and str(first["worker_job_id"]) in body["fields"]["Idempotency-Key"][0]
    assert rows(host.settings) == 1 and len(launches) == 1


def test_a_replay_after_the_job_ended_still_returns_it(api, host, db):
    _, first = post(api, host.payload())
    repo.transition(db, first["worker_job_id"], JobState.FAILED, actor="test")
    code, again = post(api, host.payload())
    assert code == 200 and again["worker_job_id"] == first["worker_job_id"] and again["status"] == "failed"


def test_without_a_key_a_retry_is_a_second_request(api, host):
    assert post(api, host.payload(), key=None)[0] == 202
    assert post(api, host.payload(), key=None)[1]["error"] == "job_active"


def test_keys_expire_with_retention(migrated, host, launches, db):
    app = create_app(replace(migrated, retention_days=0), launch=launches)
    client = app.test_client()
    _, first = post(client, host.payload())
    repo.transition(db, first["worker_job_id"], JobState.FAILED, actor="test")
    code, second = post(client, host.payload())
    assert code == 202 and second["worker_job_id"] != first["worker_job_id"]
    assert repo.get_job(db, first["worker_job_id"]).idempotency_key is None
    app.extensions["lora_worker"].db.dispose()


@pytest.mark.parametrize("key", ["", "x" * 129, "with space", "naïve"])
def test_a_malformed_key_is_a_422(api, host, launches, key):
    response = api.post("/train", json=host.payload(), headers={"Idempotency-Key": key})
    assert response.status_code == 422 and "Idempotency-Key" in response.get_json()["fields"]
    assert rows(host.settings) == 0 and launches == []


@pytest.mark.slow
def test_a_retry_storm_of_one_key_creates_exactly_one_job(host, migrated):
    set_modes(host.sd_scripts, hang_in="training")
    svc = Service(migrated, host.root / "gunicorn.log").start()
    try:
        answers: list[tuple[int, dict]] = []
        barrier = threading.Barrier(16)

        def retry() -> None:
            barrier.wait()
            code, body, _ = svc.request("POST", "/train", host.payload(), headers={"Idempotency-Key": "storm-1"})
            answers.append((code, body))

        threads = [threading.Thread(target=retry) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        codes = sorted(code for code, _ in answers)
        assert codes.count(202) == 1 and set(codes) == {200, 202}, answers
        assert len({body["worker_job_id"] for _, body in answers}) == 1
        assert rows(migrated) == 1
        job_id = answers[0][1]["worker_job_id"]
        svc.request("POST", f"/train/{job_id}/cancel")
        wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["status"] == "cancelled", what="cancelled")
    finally:
        svc.stop()


class FailsOnce(list):
    """A supervisor launcher that cannot start the first supervisor (a full /tmp, a fork refused), then can."""

    def __call__(self, job_id: int, settings: object) -> None:
        from lora_worker.errors import LaunchFailed

        self.append(job_id)
        if len(self) == 1:
            raise LaunchFailed("The supervisor did not start in 15s.", job_id=job_id)


def test_a_retry_of_a_failed_launch_with_the_same_key_launches_again(migrated, host, db):
    launches = FailsOnce()
    app = create_app(migrated, launch=launches)
    client = app.test_client()
    try:
        code, failed = post(client, host.payload())
        assert code == 503 and failed["error"] == "launch_failed" and failed["retryable"] is True
        code, retried = post(client, host.payload())
        assert code == 202, retried  # launched again, not the failed job replayed with 200
        first = launches[0]  # the row of the launch that failed: on record, without the key
        assert retried["worker_job_id"] != first and len(launches) == 2 and rows(host.settings) == 2
        assert repo.get_job(db, first).status == "failed" and repo.get_job(db, first).failure_class == "launch_error"
        assert repo.get_job(db, first).idempotency_key is None
        code, again = post(client, host.payload())  # the key now belongs to the job that launched
        assert code == 200 and again["worker_job_id"] == retried["worker_job_id"]
    finally:
        app.extensions["lora_worker"].db.dispose()

"""Long poll: GET /train/<id>?wait=S&since=V answers as soon as the job changes, and never starves a cancel."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest

from lora_worker import create_app
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from lora_worker.web.service import retry_after_s
from lora_worker.host.locks import hold_lock, job_lock_path
from tests.helpers import set_modes, wait_for
from tests.helpers.service import Service
from tests.helpers import Launches
from tests.helpers.ledger import columns


@pytest.fixture
def supervised(migrated, db):
    """A running job whose "supervisor" (this test) holds the job lock, so reconcile leaves it alone."""
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    fd = hold_lock(job_lock_path(migrated, job.id))
    yield job.id, repo.get_job(db, job.id).version
    os.close(fd)


def test_a_long_poll_returns_as_soon_as_the_version_changes(api, db, supervised):
    job_id, version = supervised
    threading.Timer(0.5, lambda: repo.update_running(db, job_id, step=5)).start()
    started = time.monotonic()
    body = api.get(f"/train/{job_id}?wait=10&since={version}").get_json()
    took = time.monotonic() - started
    assert body["step"] == 5 and body["version"] > version
    assert 0.4 < took < 3


def test_without_a_change_it_waits_the_time_asked_then_answers(api, supervised):
    job_id, version = supervised
    started = time.monotonic()
    body = api.get(f"/train/{job_id}?wait=0.6&since={version}").get_json()
    assert body["version"] == version and 0.5 < time.monotonic() - started < 3


def test_an_outdated_since_or_no_since_answers_at_once(api, supervised):
    job_id, version = supervised
    started = time.monotonic()
    api.get(f"/train/{job_id}?wait=10&since={version - 1}")
    api.get(f"/train/{job_id}?wait=10")
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("query", ["wait=26&since=1", "wait=-1&since=1", "wait=x", "since=-3", "bogus=1"])
def test_out_of_bounds_waits_are_422(api, supervised, query):
    job_id, _ = supervised
    response = api.get(f"/train/{job_id}?{query}")
    assert response.status_code == 422 and response.is_json


def test_when_the_long_poll_slots_are_taken_the_answer_comes_at_once_with_retry_after(migrated, db, supervised):
    job_id, version = supervised
    app = create_app(replace(migrated, long_poll_slots=1), launch=Launches())
    client = app.test_client()
    held: list = []
    holder = threading.Thread(target=lambda: held.append(client.get(f"/train/{job_id}?wait=2&since={version}")))
    holder.start()
    time.sleep(0.3)
    started = time.monotonic()
    turned_away = client.get(f"/train/{job_id}?wait=6&since={version}")
    assert time.monotonic() - started < 1
    assert turned_away.status_code == 200 and turned_away.get_json()["version"] == version
    assert 3 <= int(turned_away.headers["Retry-After"]) <= 6  # half to all of the wait asked for
    holder.join()
    assert "Retry-After" not in held[0].headers  # the poll that had a slot waited: nothing to retry
    app.extensions["lora_worker"].db.dispose()


def test_answers_that_did_not_need_a_slot_carry_no_retry_after(api, supervised):
    job_id, version = supervised
    for query in ("", f"?wait=10&since={version - 1}", f"?wait=0&since={version}"):
        response = api.get(f"/train/{job_id}{query}")
        assert response.status_code == 200 and "Retry-After" not in response.headers


def test_retry_after_spreads_pollers_turned_away_together():
    draws = [retry_after_s(25) for _ in range(300)]
    assert min(draws) >= 13 and max(draws) <= 25
    assert len(set(draws)) > 5  # not one instant at which they all come back
    assert {retry_after_s(0.2) for _ in range(20)} == {1}  # whole seconds, never 0


@pytest.mark.slow
def test_a_cancel_gets_through_while_long_polls_wait(host, migrated):
    set_modes(host.sd_scripts, hang_in="training")
    svc = Service(migrated, host.root / "gunicorn.log").start()
    try:
        job_id = svc.request("POST", "/train", host.payload())[1]["worker_job_id"]
        wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["phase"] == "training", what="training")
        version = svc.request("GET", f"/train/{job_id}")[1]["version"]
        answers: list[tuple[float, dict]] = []

        def poll() -> None:
            code, body, _ = svc.request("GET", f"/train/{job_id}?wait=20&since={version}")
            answers.append((time.monotonic(), body))

        pollers = [threading.Thread(target=poll) for _ in range(10)]  # more than gunicorn has threads
        for t in pollers:
            t.start()
        time.sleep(1.0)
        started = time.monotonic()
        code, body, _ = svc.request("POST", f"/train/{job_id}/cancel", timeout=10)
        cancel_took = time.monotonic() - started
        assert code == 202 and body["cancel_requested_at"] and cancel_took < 3
        for t in pollers:
            t.join(30)
        assert len(answers) == 10
        # past the long-poll slots a poller is answered at once; every one that waited saw the change
        # within moments of the cancel, not after its 20 s
        waited = [(at, b) for at, b in answers if at > started]
        assert len(waited) >= migrated.long_poll_slots
        assert all(at - started < 5 and b["version"] > version for at, b in waited)
        assert all(b["version"] == version for at, b in answers if at <= started)
        wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["status"] == "cancelled", what="cancelled")
    finally:
        svc.stop()

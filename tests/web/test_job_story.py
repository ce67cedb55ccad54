"""The whole story in one GET: the accepted request echoed, the phase a finished job ended in, no ETA once it is
over; and POST /train/<id>/cancel?wait=S, which answers once the job has ended."""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from lora_worker import create_app
from lora_worker.host.locks import hold_lock, job_lock_path
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from tests.helpers import Launches, set_modes, wait_for
from tests.helpers.ledger import columns
from tests.helpers.cli import jobs


@pytest.fixture
def running(migrated, db) -> Iterator[int]:
    """A running job in training whose "supervisor" (this test) holds the job lock, so reconcile leaves it."""
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", phase="training")
    repo.update_running(db, job.id, step=12, eta_s=19.06, eta_basis="measured")
    fd = hold_lock(job_lock_path(migrated, job.id))
    yield job.id
    os.close(fd)


def end_later(db, job_id: int, after_s: float, state: JobState = JobState.CANCELLED) -> threading.Timer:
    """What the supervisor does once the trainer is gone: write the terminal state."""
    timer = threading.Timer(after_s, lambda: repo.transition(db, job_id, state, actor="supervisor"))
    timer.start()
    return timer


# -- the request, echoed --------------------------------------------------------------------------------------

def test_get_echoes_the_accepted_request_with_its_resolved_paths_and_the_defaults_it_took(api, host, db):
    payload = host.payload()
    job_id = api.post("/train", json=payload).get_json()["worker_job_id"]
    echo = api.get(f"/train/{job_id}").get_json()["request"]
    row = repo.get_job(db, job_id)
    assert echo == {
        "dataset_dir": row.dataset_dir, "base_model_path": row.base_model_path, "output_dir": row.output_dir,
        "output_name": payload["output_name"], "trigger": payload["trigger"],
        "subject_class": payload["subject_class"], "repeats": payload["repeats"], "tier": payload["tier"],
        "device_index": payload["device_index"], "seed": payload["seed"],
        "max_grad_norm": 1.0, "lora_target_modules": "attn_mlp",  # what the trainer got for the absent fields
        "samples": [{"prompt": "photo of ohwx woman", "seed": 42}],  # the default prompt, its fixed seed
    }
    assert [echo[k] for k in ("dataset_dir", "base_model_path", "output_dir")] == [
        os.path.realpath(payload[k]) for k in ("dataset_dir", "base_model_path", "output_dir")]
    assert api.get("/train").get_json()["jobs"][0]["request"] == echo  # the list tells the same story


def test_the_optional_values_are_echoed_as_sent(api, host):
    payload = host.payload(max_grad_norm=0.5, lora_target_modules="attn_mlp_conv", seed=7)
    job_id = api.post("/train", json=payload).get_json()["worker_job_id"]
    echo = api.get(f"/train/{job_id}").get_json()["request"]
    assert (echo["max_grad_norm"], echo["lora_target_modules"], echo["seed"]) == (0.5, "attn_mlp_conv", 7)


# -- how it ended ---------------------------------------------------------------------------------------------

def test_a_finished_job_says_the_phase_it_ended_in_and_an_active_one_does_not(api, db, running):
    live = api.get(f"/train/{running}").get_json()
    assert (live["phase"], live["ended_in_phase"], live["eta_s"]) == ("training", None, 19.06)
    repo.transition(db, running, JobState.CANCELLED, actor="supervisor")
    over = api.get(f"/train/{running}").get_json()
    assert (over["status"], over["phase"], over["ended_in_phase"]) == ("cancelled", "training", "training")


def test_a_job_cancelled_in_the_queue_ended_in_no_phase(api, host):
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    assert api.post(f"/train/{job_id}/cancel").status_code == 202
    body = api.get(f"/train/{job_id}").get_json()
    assert (body["status"], body["phase"], body["ended_in_phase"]) == ("cancelled", None, None)


def test_after_supervisor_lost_the_eta_is_gone_from_the_ledger_and_the_answer(api, db, migrated):
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", phase="training")
    repo.update_running(db, job.id, step=12, eta_s=19.06, eta_basis="measured")
    body = api.get(f"/train/{job.id}").get_json()  # no supervisor holds its lock: reconcile settles it
    assert (body["status"], body["failure_class"], body["ended_in_phase"]) == ("failed", "supervisor_lost",
                                                                                "training")
    assert (body["eta_s"], body["eta_basis"]) == (None, None)
    row = repo.get_job(db, job.id)
    assert (row.eta_s, row.eta_basis) == (None, None)  # reconcile's write cleared it, not only the answer
    code, out = jobs(migrated, "show", str(job.id))
    assert code == 0 and "eta" not in out


def test_a_finished_row_that_kept_an_eta_shows_none(api, db, migrated, running):
    repo.transition(db, running, JobState.FAILED, actor="supervisor", failure_class="cuda_oom")
    conn = sqlite3.connect(db.path)  # a row written before terminal writes cleared the ETA
    with conn:
        conn.execute("UPDATE jobs SET eta_s = 19.06, eta_basis = 'measured' WHERE id = ?", (running,))
    conn.close()
    body = api.get(f"/train/{running}").get_json()
    assert (body["eta_s"], body["eta_basis"]) == (None, None)
    code, out = jobs(migrated, "show", str(running))
    assert code == 0 and "  progress:         12/400 steps\n" in out and "eta" not in out


def test_jobs_show_prints_the_eta_of_a_running_job(migrated, running):
    code, out = jobs(migrated, "show", str(running))
    assert code == 0 and "eta 19 s" in out


# -- cancel?wait ----------------------------------------------------------------------------------------------

def test_a_cancel_with_wait_answers_as_soon_as_the_job_has_ended(api, db, running):
    end_later(db, running, 0.5)
    started = time.monotonic()
    response = api.post(f"/train/{running}/cancel?wait=10")
    took = time.monotonic() - started
    assert response.status_code == 200 and response.get_json()["status"] == "cancelled"
    assert response.get_json()["cancel_requested_at"] and 0.4 < took < 3


def test_a_cancel_with_wait_answers_after_the_seconds_with_the_state_then(api, running):
    started = time.monotonic()
    response = api.post(f"/train/{running}/cancel?wait=0.6")
    assert response.status_code == 202 and 0.5 < time.monotonic() - started < 3
    body = response.get_json()
    assert body["status"] == "running" and body["cancel_requested_at"]


def test_a_job_whose_trainer_finished_meanwhile_is_answered_as_it_ended(api, db, running):
    end_later(db, running, 0.3, JobState.SUCCEEDED)  # its trainer had ended: the cancel stopped nothing
    response = api.post(f"/train/{running}/cancel?wait=10")
    assert response.status_code == 200 and response.get_json()["status"] == "succeeded"  # states.CANCEL_RULE


def test_a_job_that_failed_on_its_own_meanwhile_is_answered_as_it_ended(api, db, running):
    end_later(db, running, 0.3, JobState.FAILED)
    response = api.post(f"/train/{running}/cancel?wait=10")
    assert response.status_code == 200 and response.get_json()["status"] == "failed"


def test_a_queued_job_is_cancelled_at_once_and_the_wait_ends_there(api, host):
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    started = time.monotonic()
    response = api.post(f"/train/{job_id}/cancel?wait=30")
    assert response.status_code == 200 and response.get_json()["status"] == "cancelled"
    assert time.monotonic() - started < 1


def test_without_wait_a_cancel_answers_at_once_as_before(api, running):
    started = time.monotonic()
    response = api.post(f"/train/{running}/cancel")
    assert response.status_code == 202 and response.get_json()["status"] == "running"
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("wait", ["0", "-1", "60.5", "61", "x", "nan", ""])
def test_a_wait_out_of_bounds_is_a_422_that_cancels_nothing(api, db, running, wait):
    response = api.post(f"/train/{running}/cancel?wait={wait}")
    assert response.status_code == 422 and response.get_json()["error"] and "wait" in response.get_json()["fields"]
    assert repo.get_job(db, running).cancel_requested_at is None


def test_an_unknown_cancel_parameter_is_a_422(api, db, running):
    assert api.post(f"/train/{running}/cancel?bogus=1").status_code == 422
    assert repo.get_job(db, running).cancel_requested_at is None


def test_waiting_cancels_take_a_long_poll_slot_so_they_never_starve_the_threads(migrated, db, running):
    app = create_app(replace(migrated, long_poll_slots=1), launch=Launches())
    client = app.test_client()
    try:
        holder = threading.Thread(target=lambda: client.post(f"/train/{running}/cancel?wait=2"))
        holder.start()
        time.sleep(0.3)
        started = time.monotonic()
        # the one slot is taken: this cancel is recorded (it already was) and answered at once
        assert client.post(f"/train/{running}/cancel?wait=20").status_code == 202
        assert client.get(f"/train/{running}?wait=20&since=1").status_code == 200
        assert time.monotonic() - started < 1
        holder.join()
    finally:
        app.extensions["lora_worker"].db.dispose()


@pytest.mark.slow
def test_a_real_run_cancelled_with_wait_answers_cancelled_with_every_process_gone(client, host):
    set_modes(host.sd_scripts, hang_in="training", record=str(host.root / "record.json"))
    job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
    wait_for(lambda: client.get(f"/train/{job_id}").get_json()["phase"] == "training", what="training")
    response = client.post(f"/train/{job_id}/cancel?wait=30")
    body = response.get_json()
    assert response.status_code == 200, body
    assert (body["status"], body["ended_in_phase"], body["eta_s"]) == ("cancelled", "training", None)


# -- documented -----------------------------------------------------------------------------------------------

def test_the_document_describes_the_echo_the_ending_and_the_waiting_cancel(migrated, db, running):
    from openapi_schema_validator import OAS30Validator

    from lora_worker.web.schemas.job import AcceptedRequestSchema

    app = create_app(migrated, launch=Launches())
    client = app.test_client()
    try:
        document = client.get("/openapi.json").get_json()
        components = document["components"]
        job = components["schemas"]["Job"]["properties"]
        assert job["request"]["allOf"] == [{"$ref": "#/components/schemas/AcceptedRequest"}]
        assert set(components["schemas"]["AcceptedRequest"]["properties"]) == set(AcceptedRequestSchema().fields)
        assert job["ended_in_phase"]["nullable"] and "ended in" in job["ended_in_phase"]["description"]
        assert "teardown" in job["eta_s"]["description"]
        cancel = document["paths"]["/train/{job_id}/cancel"]["post"]
        (wait,) = [p for p in cancel["parameters"] if p["in"] == "query"]
        assert wait["name"] == "wait" and (wait["schema"]["maximum"], wait["schema"]["exclusiveMinimum"]) == (60, True)
        assert {"200", "202", "422"} <= set(cancel["responses"])
        end_later(db, running, 0.3)
        tour = [client.post(f"/train/{running}/cancel?wait=61"), client.post(f"/train/{running}/cancel?wait=5"),
                client.get(f"/train/{running}")]
        assert [r.status_code for r in tour] == [422, 200, 200]
        for response, op in zip(tour, (cancel, cancel, document["paths"]["/train/{job_id}"]["get"])):
            schema = op["responses"][str(response.status_code)]["content"]["application/json"]["schema"]
            OAS30Validator({**schema, "components": components}).validate(response.get_json())
    finally:
        app.extensions["lora_worker"].db.dispose()

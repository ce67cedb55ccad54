"""Status codes a client can act on: 409 only for busy-now, every error says whether a retry can help, a wait
that is known travels as Retry-After, and docs/errors.md's table is the OpenAPI document's."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lora_worker import create_app
from lora_worker.web.errors import BY_CODE, CATALOGUE, answered_errors, status_of
from tests.helpers import fake_gpus, hold_exclusive
from tests.helpers.docs import errors_doc_table

BUSY_NOW = {"job_active", "gpu_busy", "gpu_locked", "insufficient_vram"}


@pytest.fixture
def document(api):
    return api.get("/openapi.json").get_json()


def assert_error(response, status: int, code: str) -> dict:
    body = response.get_json()
    assert response.status_code == status and body["error"] == code and body["status"] == status, body
    assert body["retryable"] is BY_CODE[code].retryable, body
    return body


def test_the_errors_doc_table_is_the_documents_error_catalogue(document):
    assert errors_doc_table() == document["x-errors"]
    assert len(document["x-errors"]) == len(CATALOGUE) >= 20


def test_every_error_a_route_documents_is_in_the_catalogue_with_its_status(document):
    listed = set()
    for path, item in document["paths"].items():
        for method, op in item.items():
            for status, response in op["responses"].items():
                for code in response.get("x-errors", []):
                    assert BY_CODE[code].status == int(status), (path, method, code)
                    listed.add(code)
    # The catalogue has nothing no route answers, but for the errors any route can meet.
    assert {e.error for e in CATALOGUE} - listed == {"not_found", "method_not_allowed", "internal_error"}


def test_post_train_answers_409_only_for_busy_now_and_each_of_those_is_retryable(document):
    responses = document["paths"]["/train"]["post"]["responses"]
    assert set(responses["409"]["x-errors"]) == BUSY_NOW
    assert all(BY_CODE[code].retryable for code in BUSY_NOW)
    assert "output_exists" in responses["422"]["x-errors"] and responses["507"]["x-errors"] == ["insufficient_disk"]
    assert all(not e.retryable for e in CATALOGUE if e.status in (400, 401, 404, 413, 422, 507))


def test_every_domain_error_a_client_can_meet_has_one_entry_with_its_status_and_retryable():
    for cls in answered_errors():
        entry = BY_CODE[cls.code]
        assert (entry.status, entry.retryable) == (status_of(cls), cls.retryable), cls


def test_real_errors_carry_retryable_and_the_catalogues_status(api, host, migrated, launches):
    assert_error(api.post("/train", data=b"{nope", content_type="application/json"), 400, "bad_request")
    assert_error(api.get("/train/999"), 404, "job_not_found")
    assert_error(api.get("/no/such/route"), 404, "not_found")
    assert_error(api.delete("/train"), 405, "method_not_allowed")
    assert_error(api.post("/train", data=b"x" * 70_000, content_type="application/json"), 413,
                 "request_entity_too_large")
    assert_error(api.post("/train", json={"tier": "fast"}), 422, "validation_failed")
    fake_gpus(host.gpus, free1=10)
    assert_error(api.post("/train", json=host.payload()), 409, "insufficient_vram")
    fake_gpus(host.gpus, absent=True)
    assert_error(api.post("/train", json=host.payload()), 503, "nvml_unavailable")
    assert launches == []


def test_a_token_refusal_is_not_retryable(migrated, tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 40)
    client = create_app(replace(migrated, api_token_file=token), launch=lambda *_: None).test_client()
    body = assert_error(client.get("/train"), 401, "unauthorized")
    assert body["retryable"] is False


def test_job_active_is_a_retryable_409_naming_the_active_job(api, host, migrated):
    first = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    busy = api.post("/train", json=host.payload(output_name="second"))
    body = assert_error(busy, 409, "job_active")
    # No Retry-After, even once the job has an ETA: an estimate is not a known wait (test_error_contract.py).
    assert body["details"]["active_job_id"] == first and "Retry-After" not in busy.headers


def test_cancelling_an_ended_job_is_a_409_job_finished_with_its_final_state(api, host):
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    assert api.post(f"/train/{job_id}/cancel").get_json()["status"] == "cancelled"  # queued: cancelled at once
    body = assert_error(api.post(f"/train/{job_id}/cancel"), 409, "job_finished")
    assert body["details"]["status"] == "cancelled" and body["retryable"] is False


@pytest.mark.slow
def test_a_locked_ledger_is_a_retryable_503_with_retry_after(migrated, host):
    client = create_app(replace(migrated, busy_timeout_s=0.2), launch=lambda *_: None).test_client()
    holder = hold_exclusive(migrated.database_path, 3.0)
    try:
        response = client.post("/train", json=host.payload())
    finally:
        holder.join()
    assert_error(response, 503, "ledger_busy")
    assert response.headers["Retry-After"] == "1"

"""The error contract has no holes: every code the worker can emit is in the one catalogue, every error body has
the one shape (with `retryable`), werkzeug's browser sentences never reach a client, and a Retry-After is sent
only from a figure the worker knows."""
from __future__ import annotations

import json
import re
import shutil
import sqlite3
import types

from lora_worker.config import REPO_ROOT
from lora_worker.web.buffered_worker import BufferingThreadWorker
from lora_worker.web.errors import BY_CODE, CATALOGUE
from lora_worker.web.openapi import _entry
from tests.helpers.docs import errors_doc_table

PACKAGE = REPO_ROOT / "lora_worker"
EMITTED = (re.compile(r'error_response\(\s*(\d{3}),\s*"([a-z_]+)"'),  # the web layer's own answers
           re.compile(r'_answer\(\s*conn,\s*(\d{3}),\s*"([a-z_]+)"'))  # the buffering worker's, before Flask
FAMILIES = ("LoraWorkerError", "Conflict", "Unavailable", "InsufficientStorage")  # codes no client may get


def sources() -> dict[str, str]:
    return {str(p.relative_to(REPO_ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_code_emitted_anywhere_is_in_the_catalogue_with_its_status():
    found = []
    for name, text in sources().items():
        for pattern in EMITTED:
            for status, code in pattern.findall(text):
                found.append((name, int(status), code))
        for family in FAMILIES:  # a family raised by itself answers with a code that is in no catalogue
            assert not re.search(rf"raise {family}\(", text), (name, family)
    assert len(found) >= 6
    for name, status, code in found:
        assert code in BY_CODE and BY_CODE[code].status == status, (name, status, code)


def test_the_buffering_workers_answers_have_the_error_shape_with_retryable():
    sent: list[bytes] = []
    fake = types.SimpleNamespace(_send_now=lambda conn, data: sent.append(data), _close=lambda conn: None)
    for status, code in ((408, "request_timeout"), (411, "length_required"), (413, "request_entity_too_large")):
        BufferingThreadWorker._answer(fake, object(), status, code, "why")  # type: ignore[arg-type]
        body = json.loads(sent[-1].split(b"\r\n\r\n", 1)[1])
        assert body == {"error": code, "message": "why", "status": status, "retryable": BY_CODE[code].retryable}


def test_malformed_json_is_the_json_error_shape_saying_where(api):
    response = api.post("/train", data=b'{"tier": fast}', content_type="application/json")
    body = response.get_json()
    assert response.status_code == 400 and body["error"] == "bad_request" and body["retryable"] is False
    assert body["message"].startswith("The body is not valid JSON: Expecting value: line 1 column 10")
    assert "browser" not in body["message"]


def test_werkzeugs_browser_sentences_are_replaced_by_the_catalogues_advice(api):
    for response, code in ((api.get("/no-such-route"), "not_found"), (api.delete("/train"), "method_not_allowed")):
        body = response.get_json()
        assert body["error"] == code and body["message"] == BY_CODE[code].advice, body


def test_a_missing_train_root_is_a_catalogued_503(api, host, launches):
    shutil.rmtree(host.settings.train_root)
    response = api.post("/train", json=host.payload())
    body = response.get_json()
    assert response.status_code == 503 and body["error"] == "train_root_missing", body
    assert body["retryable"] is False and BY_CODE["train_root_missing"].status == 503
    assert launches == []


def test_job_active_sends_no_retry_after_from_a_guessed_eta(api, host, launches):
    first = api.post("/train", json=host.payload())
    assert first.status_code == 202
    conn = sqlite3.connect(host.settings.database_path)
    with conn:
        conn.execute("UPDATE jobs SET eta_s = 120 WHERE id = ?", (first.get_json()["worker_job_id"],))
    conn.close()
    second = api.post("/train", json=host.payload(output_name="other"))
    assert second.status_code == 409 and second.get_json()["error"] == "job_active"
    assert "Retry-After" not in second.headers
    assert BY_CODE["job_active"].retry_after == ""  # the catalogue (and so docs/errors.md) says so


def test_the_errors_doc_table_is_the_catalogue():
    assert errors_doc_table() == [_entry(entry) for entry in CATALOGUE]


def client_flow_rows() -> list[str]:
    """The first cells of docs/errors.md's client table ("The client flow"): what arbo does on each answer."""
    text = (REPO_ROOT / "docs" / "errors.md").read_text()
    section = text.split("**The client flow.**", 1)[1].split("The worker itself never retries", 1)[0]
    return [line.split(" | ")[0].strip("| ") for line in section.splitlines() if re.match(r"^\| \d{3}", line)]


def test_the_errors_doc_client_table_names_only_catalogued_codes_and_covers_every_one():
    cells = client_flow_rows()
    named = {code for cell in cells for code in re.findall(r"`([a-z_]+)`", cell)} - {"fields"}  # a body field
    statuses = {int(n) for cell in cells for n in re.findall(r"\b(\d{3})\b", cell)}
    assert named and named <= set(BY_CODE), named - set(BY_CODE)
    uncovered = [e.error for e in CATALOGUE if e.error not in named and e.status not in statuses]
    assert uncovered == []  # arbo is told what to do on every answer the worker can give

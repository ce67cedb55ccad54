"""Hostile input to POST /train, field by field: never a 5xx, always the JSON error shape, and nothing written
or started for a refused request."""
from __future__ import annotations

import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lora_worker import create_app
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from tests.helpers import Launches, job_rows
from tests.helpers.examples import examples

FIELDS = ("dataset_dir", "base_model_path", "output_dir", "output_name", "trigger", "subject_class", "repeats",
          "tier", "device_index", "seed", "max_grad_norm", "lora_target_modules")
NASTY = [
    "../../etc/passwd", "/worktank/arbo/train/../../etc", "..", ".", "./x", "~root", "/proc/self/cwd", "/dev/zero",
    "C:\\Windows\\system32", "%2e%2e%2f", "a\x00b", "line\nbreak", "tab\tbed", "\u202eevil", "zero\u200bwidth",
    "ｆｕｌｌｗｉｄｔｈ", "cafe\u0301", "--config_file=/etc/passwd", "-rf", "$(reboot)", "`id`", "x" * 5000,
    "/" * 300, "\U0001f600", "NaN", "Infinity", "1e400", "", " ", "null",
]
values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=80), st.sampled_from(NASTY),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
mutation = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(FIELDS), values),
    st.tuples(st.just("drop"), st.sampled_from(FIELDS), st.none()),
    st.tuples(st.just("extra"), st.text(min_size=1, max_size=20), values),
)


@pytest.fixture
def fuzz_app(migrated, host):
    launches = Launches()
    app = create_app(migrated, launch=launches)
    yield app.test_client(), launches, app.extensions["lora_worker"].db
    app.extensions["lora_worker"].db.dispose()


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_hostile_requests_are_refused_cleanly(fuzz_app, host, mutations):
    client, launches, db = fuzz_app
    fresh_output = host.dataset.parent / f"out-{uuid.uuid4().hex}"
    body = host.payload(output_dir=str(fresh_output))
    for kind, key, value in mutations:
        if kind == "drop":
            body.pop(key, None)
        else:
            body[key] = value
    rows, started = job_rows(host.settings), len(launches)
    response = client.post("/train", data=json.dumps(body, allow_nan=True), content_type="application/json")
    assert response.status_code < 500, response.get_data(as_text=True)
    answer = response.get_json()
    if response.status_code in (200, 202):  # a mutation that happened to be valid: end the job for the next one
        repo.transition(db, answer["worker_job_id"], JobState.FAILED, actor="test")
        return
    assert set(answer) >= {"error", "message", "status"} and answer["status"] == response.status_code
    assert job_rows(host.settings) == rows and len(launches) == started
    assert not fresh_output.exists()  # a refused request creates no directory either


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_any_bytes_as_a_body_are_a_4xx(fuzz_app, host, raw):
    client, launches, _ = fuzz_app
    response = client.post("/train", data=raw, content_type="application/json")
    assert 400 <= response.status_code < 500 and response.is_json
    assert launches == []

"""Schemathesis against GET /openapi.json: every operation, with data generated from the document itself,
valid and invalid: no 5xx, every answer matches its documented schema, status and content type, and a
refused request writes no row and starts nothing.

(Schemathesis' own pytest plugin does not load under pytest 9, so the cases are drawn from each operation's
Hypothesis strategy here, and checked with the same call_and_validate.)"""
from __future__ import annotations

from dataclasses import replace

import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from schemathesis import GenerationMode

from lora_worker import create_app
from tests.helpers import job_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# A request can match the schema and still be refused (a dataset_dir that does not exist on this host is a
# 422, by design), so schemathesis' "positive data is accepted" check does not apply here.
EXCLUDED = [schemathesis.checks.positive_data_acceptance]


TOKEN = "s" * 43  # as secrets.token_urlsafe(32) would make


@pytest.fixture
def api_schema(migrated, launches, tmp_path):
    """The app as deployed: behind a bearer token (the document says every route but /healthz needs one)."""
    token_file = tmp_path / "api_token"
    token_file.write_text(TOKEN + "\n")
    app = create_app(replace(migrated, api_token_file=token_file, bind="0.0.0.0:8203"), launch=launches)
    yield schemathesis.openapi.from_wsgi("/openapi.json", app, headers={"Authorization": f"Bearer {TOKEN}"})
    app.extensions["lora_worker"].db.dispose()


def test_the_document_lists_every_operation(api_schema):
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert {"POST /train", "GET /train", "GET /train/{job_id}", "GET /train/{job_id}/log",
            "POST /train/{job_id}/cancel", "GET /train/{job_id}/progress", "GET /gpu-status", "GET /healthz",
            "GET /metrics"} <= labels  # schemathesis leaves out the document's own route


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_operation_answers_as_documented(api_schema, migrated, launches, mode, data):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    operation = data.draw(st.sampled_from(operations), label="operation")
    case = data.draw(operation.as_strategy(generation_mode=mode), label="case")
    # An extra query parameter with no name and an empty value ([] or {}) is serialised to nothing: the
    # request that reaches the app is valid, and "negative data accepted" would be a false alarm of the harness.
    assume((case.query or {}).get("") not in ([], {}))
    rows, started = job_rows(migrated), len(launches)
    response = case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, excluded_checks=EXCLUDED)
    if response.status_code >= 400:
        assert job_rows(migrated) == rows and len(launches) == started, case.as_curl_command()

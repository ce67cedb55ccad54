"""GET /openapi.json: every route of the URL map documented from the marshmallow schemas, errors included, and
real answers that match what it says."""
from __future__ import annotations

from typing import Any

import pytest
from apispec_webframeworks.flask import FlaskPlugin
from openapi_schema_validator import OAS30Validator
from openapi_spec_validator import validate

from lora_worker import create_app
from lora_worker.web.openapi import documented_methods
from lora_worker.web.schemas.job import JobListQuerySchema, TrainRequestSchema
from lora_worker.web.schemas.log import LogQuerySchema


@pytest.fixture
def api(migrated):
    app = create_app(migrated, launch=lambda job_id, settings: None)
    yield app
    app.extensions["lora_worker"].db.dispose()


@pytest.fixture
def document(api) -> dict[str, Any]:
    response = api.test_client().get("/openapi.json")
    assert response.status_code == 200 and response.is_json
    return response.get_json()


def operations(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(path, method): op for path, item in document["paths"].items() for method, op in item.items()}


def test_every_route_in_the_url_map_is_documented(api, document):
    served = {(FlaskPlugin.flaskpath2openapi(rule.rule), method.lower())
              for rule in api.url_map.iter_rules() for method in documented_methods(rule)}
    documented = set(operations(document))
    assert served - documented == set(), "routes without documentation"
    assert documented - served == set(), "documentation of routes that do not exist"
    assert {("/train", "post"), ("/train/{job_id}", "get"), ("/train/{job_id}/log", "get"),
            ("/train/{job_id}/cancel", "post"), ("/gpu-status", "get"), ("/healthz", "get"), ("/metrics", "get"),
            ("/openapi.json", "get")} <= served


def test_the_document_is_a_valid_openapi_3_document(document):
    assert document["openapi"].startswith("3.0")
    validate(document)  # raises with the first violation of the OpenAPI 3.0 schema


def test_every_operation_documents_its_errors_in_the_one_error_shape(document):
    error_ref = {"$ref": "#/components/schemas/Error"}
    assert set(document["components"]["schemas"]["Error"]["required"]) == {"error", "message", "status",
                                                                          "retryable"}
    for (path, method), op in operations(document).items():
        statuses = {int(code) for code in op["responses"]}
        assert any(200 <= s < 300 for s in statuses), (path, method)
        for status in statuses - set(range(200, 300)):
            assert op["responses"][str(status)]["content"]["application/json"]["schema"] == error_ref
        if path == "/healthz":
            assert op["security"] == [] and 401 not in statuses
        else:
            assert "security" not in op and 401 in statuses, (path, method)  # the global bearer requirement
            assert "WWW-Authenticate" in op["responses"]["401"]["headers"]
    assert document["security"] == [{"bearer": []}]
    assert document["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}


def test_requests_are_documented_from_their_schemas(document):
    ops = operations(document)
    body = ops[("/train", "post")]["requestBody"]["content"]["application/json"]["schema"]
    train_request = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    required = {name for name, field in TrainRequestSchema().fields.items() if field.required}
    assert set(train_request["required"]) == required and set(train_request["properties"]) == set(
        TrainRequestSchema().fields)
    assert train_request["additionalProperties"] is False  # unknown fields are a 422
    for path, schema in (("/train", JobListQuerySchema), ("/train/{job_id}/log", LogQuerySchema)):
        query = {p["name"] for p in ops[(path, "get")]["parameters"] if p["in"] == "query"}
        assert query == set(schema().fields), path
    for path, method in ops:
        if "{job_id}" in path:
            (param,) = [p for p in ops[(path, method)]["parameters"] if p["in"] == "path" and p["name"] == "job_id"]
            assert param == {"in": "path", "name": "job_id", "required": True,
                             "schema": {"type": "integer", "minimum": 0}}


def answers(api, host) -> list[tuple[str, str, Any]]:
    """A tour of the API, good and bad: (path template, method, response)."""
    client = api.test_client()
    tour = [("/train", "post", client.post("/train", json=host.payload()))]
    job_id = tour[0][2].get_json()["worker_job_id"]
    tour += [
        ("/train/{job_id}", "get", client.get(f"/train/{job_id}")),
        ("/train", "get", client.get("/train?limit=1")),
        ("/train/{job_id}/log", "get", client.get(f"/train/{job_id}/log?offset=0")),
        ("/train/{job_id}/cancel", "post", client.post(f"/train/{job_id}/cancel")),
        ("/train/{job_id}/cancel", "post", client.post(f"/train/{job_id}/cancel")),  # 409: it ended
        ("/train/{job_id}", "get", client.get("/train/999")),
        ("/train", "post", client.post("/train", json={"tier": "fast"})),
        ("/train", "post", client.post("/train", data=b"{nope", content_type="application/json")),
        ("/train", "post", client.post("/train", data=b"x" * 70_000, content_type="application/json")),
        ("/train", "post", client.post("/train", json=host.payload(output_name="again"))),  # 409 or 202
        ("/train", "get", client.get("/train?limit=0")),
        ("/gpu-status", "get", client.get("/gpu-status")),
        ("/healthz", "get", client.get("/healthz")),
    ]
    return tour


def test_real_answers_match_their_documented_schemas(api, host, document):
    ops = operations(document)
    seen = set()
    for path, method, response in answers(api, host):
        documented = ops[(path, method)]["responses"]
        assert str(response.status_code) in documented, (path, method, response.status_code, response.get_json())
        schema = documented[str(response.status_code)]["content"]["application/json"]["schema"]
        # The component refs resolve against the document itself.
        OAS30Validator({**schema, "components": document["components"]}).validate(response.get_json())
        seen.add(response.status_code)
    assert {200, 202, 400, 404, 409, 413, 422} <= seen


def test_a_nullable_field_marked_not_nullable_would_be_caught(api, host, document):
    # The check above has teeth: the same job, with a field set to null that the document says is not nullable.
    client = api.test_client()
    job = client.get(f"/train/{client.post('/train', json=host.payload()).get_json()['worker_job_id']}")
    body = {**job.get_json(), "tier": None}
    schema = {"$ref": "#/components/schemas/Job", "components": document["components"]}
    assert not OAS30Validator(schema).is_valid(body)
    assert OAS30Validator(schema).is_valid(job.get_json())

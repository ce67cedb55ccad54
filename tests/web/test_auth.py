"""Auth: a bearer token on every route but /healthz, compared in constant time, never logged or passed on;
no token only on loopback."""
from __future__ import annotations

import hmac
import json
import logging
from pathlib import Path

import pytest

from lora_worker import create_app
from lora_worker.errors import ConfigError
from lora_worker.ledger import repository as repo
from tests.helpers import set_modes, wait_for
from tests.helpers.service import Service
from tests.helpers.api import TOKEN, bearer, write_token


@pytest.fixture
def token_file(host) -> Path:
    return write_token(host.root / "etc")


@pytest.fixture
def authed(migrated, token_file, monkeypatch):
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    app = create_app(migrated.with_overrides(api_token_file=token_file), launch=lambda job_id, settings: None)
    yield app
    app.extensions["lora_worker"].db.dispose()


def routes(app) -> list[tuple[str, str, str]]:
    """(endpoint, method, concrete url) for every route and method of the app (HEAD and OPTIONS too)."""
    urls = app.url_map.bind("localhost")
    return [(rule.endpoint, method, urls.build(rule.endpoint, {arg: 1 for arg in rule.arguments}))
            for rule in app.url_map.iter_rules() for method in sorted(rule.methods or ())]


def assert_401(response, invalid: bool) -> None:
    assert response.status_code == 401, (response.request.method, response.request.path, response.get_data())
    if response.request.method != "HEAD":  # a HEAD answer has no body
        body = response.get_json()
        assert body["error"] == "unauthorized" and body["status"] == 401 and body["message"]
    challenge = response.headers["WWW-Authenticate"]
    assert challenge.startswith("Bearer ") and ('error="invalid_token"' in challenge) == invalid


def test_every_route_but_healthz_answers_401_without_a_token(authed):
    client = authed.test_client()
    checked = 0
    for endpoint, method, url in routes(authed):
        response = client.open(url, method=method)
        if endpoint == "health.healthz":
            assert response.status_code == 200 and "WWW-Authenticate" not in response.headers
            continue
        assert_401(response, invalid=False)
        checked += 1
    assert checked >= 16  # the contract routes and the job list, with their HEAD and OPTIONS


@pytest.mark.parametrize("header", [f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", "Bearer " + "a" * 48,
                                    f"Basic {TOKEN}", f"bearer {TOKEN[1:]}"],
                         ids=["short", "long", "other", "basic", "lowercase"])  # the token is random: stable ids
def test_every_route_but_healthz_answers_401_with_a_wrong_token(authed, header):
    client = authed.test_client()
    for endpoint, method, url in routes(authed):
        if endpoint != "health.healthz":
            response = client.open(url, method=method, headers={"Authorization": header})
            assert_401(response, invalid=header.lower().startswith("bearer"))


def test_an_unknown_path_without_a_token_is_401_not_404(authed):
    assert_401(authed.test_client().get("/no/such/route"), invalid=False)


def test_the_right_token_opens_every_route(authed):
    client = authed.test_client()
    for _, method, url in routes(authed):
        response = client.open(url, method=method, headers=bearer(TOKEN), json={} if method == "POST" else None)
        assert response.status_code != 401, (url, response.get_json())
    assert client.get("/train", headers=bearer(TOKEN)).status_code == 200


def test_the_token_is_compared_with_hmac_compare_digest_on_bytes(authed, monkeypatch):
    calls: list[tuple[object, object]] = []
    real = hmac.compare_digest

    def spy(a, b):  # type: ignore[no-untyped-def]
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    client = authed.test_client()
    assert client.get("/train", headers=bearer(TOKEN)).status_code == 200
    assert client.get("/train", headers=bearer("x" * 40)).status_code == 401
    assert calls == [(TOKEN.encode(), TOKEN.encode()), (b"x" * 40, TOKEN.encode())]


@pytest.mark.parametrize("token", ["", "a" * 31, " " * 40, "\n"])
def test_the_service_refuses_to_start_with_a_token_shorter_than_32_bytes(migrated, host, token):
    path = write_token(host.root / "etc", token)
    with pytest.raises(ConfigError, match="at least 32"):
        create_app(migrated.with_overrides(api_token_file=path))


def test_a_token_of_exactly_32_bytes_is_accepted(migrated, host):
    path = write_token(host.root / "etc", "b" * 32)
    app = create_app(migrated.with_overrides(api_token_file=path))
    assert app.test_client().get("/train", headers=bearer("b" * 32)).status_code == 200
    app.extensions["lora_worker"].db.dispose()


def test_a_configured_token_file_that_cannot_be_read_stops_the_service(migrated, host):
    with pytest.raises(ConfigError, match="cannot read the API token file"):
        create_app(migrated.with_overrides(api_token_file=host.root / "missing"))


def test_the_systemd_credential_wins_over_the_configured_file(migrated, host, monkeypatch):
    other = "c" * 40
    credentials = host.root / "credentials"
    write_token(credentials)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    app = create_app(migrated.with_overrides(api_token_file=write_token(host.root / "etc", other)))
    client = app.test_client()
    assert client.get("/train", headers=bearer(TOKEN)).status_code == 200
    assert client.get("/train", headers=bearer(other)).status_code == 401
    app.extensions["lora_worker"].db.dispose()


@pytest.mark.parametrize("bind", ["0.0.0.0:8203", "10.1.2.3:8203", "[::]:8203", ":8203", "worker.lan:8203",
                                  "127.0.0.1:8203,0.0.0.0:9000", "fd://3"])
def test_without_a_token_the_service_refuses_to_start_off_loopback(migrated, bind, monkeypatch):
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(ConfigError, match="not loopback"):
        create_app(migrated.with_overrides(bind=bind))


@pytest.mark.parametrize("bind", ["127.0.0.1:8203", "127.0.0.2:9000", "[::1]:8203", "localhost:8203",
                                  "unix:/run/lora-worker.sock", "127.0.0.1:1,[::1]:2"])
def test_without_a_token_the_service_runs_in_dev_mode_on_loopback(migrated, bind, monkeypatch):
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    app = create_app(migrated.with_overrides(bind=bind))
    assert app.test_client().get("/train").status_code == 200
    app.extensions["lora_worker"].db.dispose()


def test_the_token_is_never_logged(migrated, host, token_file, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "w" * 44
    app = create_app(migrated.with_overrides(api_token_file=token_file), launch=lambda job_id, settings: None)
    client = app.test_client()
    client.post("/train", json=host.payload(), headers=bearer(TOKEN))
    client.get("/train/1", headers=bearer(wrong))
    client.get("/train/1/log", headers=bearer(TOKEN))
    app.extensions["lora_worker"].db.dispose()
    with pytest.raises(ConfigError) as refused:
        create_app(migrated.with_overrides(api_token_file=write_token(host.root / "short", TOKEN[:20])))
    assert caplog.records  # the app did log (job accepted, …): the scan below has something to read
    for text in (caplog.text, str(refused.value)):
        assert TOKEN not in text and TOKEN[:20] not in text and wrong not in text


@pytest.mark.slow
def test_gunicorn_tells_the_app_its_real_bind_so_a_tokenless_worker_will_not_serve_all_interfaces(migrated, host):
    # The settings say loopback; the command line says 0.0.0.0. The command line is what listens.
    service = Service(migrated, host.root / "open.log", listen="0.0.0.0")
    with pytest.raises(RuntimeError, match="gunicorn exited"):
        service.start()
    assert "not loopback" in (host.root / "open.log").read_text()


@pytest.mark.slow
def test_with_a_token_gunicorn_serves_all_interfaces_and_never_logs_the_token(migrated, host, token_file):
    service = Service(migrated.with_overrides(api_token_file=token_file), host.root / "gunicorn.log",
                      listen="0.0.0.0").start()
    try:
        assert service.request("GET", "/train")[0] == 401
        assert service.request("GET", "/train", headers=bearer("z" * 40))[0] == 401
        code, body, _ = service.request("GET", "/train", headers=bearer(TOKEN))
        assert code == 200 and body["jobs"] == []
    finally:
        service.stop()
    log = (host.root / "gunicorn.log").read_text()
    assert '"GET /train HTTP/1.1" 200' in log  # the access log is there, and it holds no header
    assert TOKEN not in log and "z" * 40 not in log


@pytest.mark.slow
def test_the_token_never_reaches_the_trainers_environment(migrated, host, monkeypatch):
    credentials = host.root / "credentials"
    write_token(credentials)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    monkeypatch.setenv("API_TOKEN", TOKEN)  # even a token an operator left in the service's environment
    record = host.root / "record.json"
    set_modes(host.sd_scripts, record=str(record))
    app = create_app(migrated)
    client = app.test_client()
    response = client.post("/train", json=host.payload(), headers=bearer(TOKEN))
    assert response.status_code == 202, response.get_json()
    job_id = response.get_json()["worker_job_id"]
    env = wait_for(lambda: record.exists() and json.loads(record.read_text()), what="trainer record")["env"]
    done = wait_for(lambda: (j := client.get(f"/train/{job_id}", headers=bearer(TOKEN)).get_json())["status"]
                    in ("succeeded", "failed", "cancelled") and j, timeout=30, what="job end")
    row = repo.get_job(app.extensions["lora_worker"].db, job_id)
    app.extensions["lora_worker"].db.dispose()
    assert done["status"] == "succeeded", done
    assert env["PATH"] and "CREDENTIALS_DIRECTORY" not in env and "API_TOKEN" not in env
    assert not any(TOKEN in value for value in env.values())
    assert TOKEN not in json.dumps(row.env) and TOKEN not in json.dumps(row.argv)

"""What the API tests share: a refusal's shape, and the bearer token a worker is given."""
from __future__ import annotations

import secrets
from pathlib import Path

from tests.helpers import job_rows as rows

TOKEN = "t0k3n-" + secrets.token_urlsafe(32)


def write_token(directory: Path, token: str = TOKEN, name: str = "api_token") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(token + "\n")  # as `echo` writes it
    path.chmod(0o600)
    return path


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_refused(response, status: int, code: str, settings, launches, field: str | None = None) -> dict:
    body = response.get_json()
    assert response.status_code == status, body
    assert response.is_json and body["error"] == code and body["status"] == status and body["message"]
    if field:
        assert field in body["fields"], body
    assert rows(settings) == 0 and launches == []
    return body


"""A job the ledger lost (the file deleted, the service restarted) but whose run log is still on disk is a 410
`job_gone` saying what is known, not a 404 as if it had never existed. The log is opened no-follow, no-block."""
from __future__ import annotations

import os

import pytest

from lora_worker import create_app
from lora_worker.ledger.migrate import upgrade
from lora_worker.web.errors import BY_CODE


@pytest.fixture
def restarted(migrated, launches):
    """Job 7's run log on disk, a fresh ledger (the old one deleted), and the service started again."""
    log = migrated.log_dir / "job-7.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("loading model for process 0/1\n")
    migrated.database_path.unlink()
    upgrade(migrated.database_path)
    app = create_app(migrated, launch=launches)
    yield app.test_client(), log
    app.extensions["lora_worker"].db.dispose()


@pytest.mark.parametrize("route", ["/train/7", "/train/7/progress", "/train/7/log"])
def test_a_job_known_only_by_its_log_is_410_with_what_is_known(restarted, route):
    client, log = restarted
    response = client.get(route)
    body = response.get_json()
    assert response.status_code == 410 and body["error"] == "job_gone", body
    assert body["retryable"] is False and BY_CODE["job_gone"].status == 410
    assert body["details"] == {"job_id": 7, "ledger": "lost", "log_path": str(log), "log_bytes": log.stat().st_size}
    assert "not in the ledger" in body["message"]


def test_a_cancel_of_such_a_job_is_410_too(restarted):
    client, _ = restarted
    assert client.post("/train/7/cancel").status_code == 410


def test_a_job_with_no_log_is_still_404(restarted):
    client, _ = restarted
    assert client.get("/train/8").status_code == 404


def test_a_link_or_a_fifo_at_the_log_is_not_followed_nor_waited_on(restarted, tmp_path):
    client, log = restarted
    secret = tmp_path / "secret.txt"
    secret.write_text("x" * 1234)
    (log.parent / "job-8.log").symlink_to(secret)
    os.mkfifo(log.parent / "job-9.log")
    assert client.get("/train/8").status_code == 404  # a link says nothing about job 8
    assert client.get("/train/9").status_code == 404  # answered at once: no open blocked on the FIFO

"""Issue #38, first case: one flipped flag bit in a saved state's `optimizer.bin` (a power cut does it, so does
anyone in the group) made zipfile raise RuntimeError past the state check: GET /train/<id>/resume answered 500,
and after a reboot the start-up auto-resume follow-up raised, create_app failed and the service never started.
Now the state is refused (`state_archive_corrupt`) and the other states, the other jobs and the service carry on."""
from __future__ import annotations

import sqlite3

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.states import FailureClass, JobState
from tests.helpers import job_rows
from tests.helpers.states import corrupt_archive, interrupted

# the encrypted flag (zipfile: RuntimeError), an unknown compression method and deflate64 (NotImplementedError)
CORRUPTIONS = {"encrypted flag": ("flags", 0x1), "unknown method": ("method", 99), "deflate64": ("method", 9)}


def submit(client, host) -> int:
    response = client.post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()
    return response.get_json()["worker_job_id"]


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_the_verdict_refuses_the_corrupt_state_and_offers_the_one_before(api, host, db, corruption):
    job_id = submit(api, host)
    output = interrupted(db, host.settings, job_id)  # states at steps 2 and 4
    field, value = CORRUPTIONS[corruption]
    corrupt_archive(output / "ohwx_lora-step00000004-state", field=field, value=value)
    answer = api.get(f"/train/{job_id}/resume")
    assert answer.status_code == 200, answer.get_json()  # 500 internal_error before
    body = answer.get_json()
    assert body["resumable"] is True and body["from_step"] == 2
    [reason] = body["reasons"]
    assert reason["code"] == "state_archive_corrupt" and "optimizer.bin" in reason["message"]
    resumed = api.post(f"/train/{job_id}/resume")
    assert resumed.status_code == 202 and resumed.get_json()["resume_step"] == 2


def test_with_every_state_corrupt_the_resume_is_a_422_with_the_reasons(api, host, db, launches):
    job_id = submit(api, host)
    output = interrupted(db, host.settings, job_id)
    for step in (2, 4):
        corrupt_archive(output / f"ohwx_lora-step{step:08d}-state")
    answer = api.post(f"/train/{job_id}/resume")
    body = answer.get_json()
    assert answer.status_code == 422 and body["error"] == "not_resumable", body
    assert [r["code"] for r in body["details"]["reasons"]] == ["state_archive_corrupt"] * 2
    assert job_rows(host.settings) == 1 and launches == [job_id]


def cut_off_by_a_reboot(client, host, db) -> int:
    """A running job whose row names another boot, with two states saved: what a power cut leaves."""
    job_id = submit(client, host)
    repo.transition(db, job_id, JobState.RUNNING, actor="test")
    conn = sqlite3.connect(host.settings.database_path)
    with conn:
        conn.execute("UPDATE jobs SET boot_id = 'a-boot-before-this-one' WHERE id = ?", (job_id,))
    conn.close()
    interrupted(db, host.settings, job_id, failure=None)
    return job_id


def test_after_a_reboot_the_service_starts_and_auto_resume_takes_the_good_state(migrated, host, db, launches):
    from lora_worker import create_app

    first = create_app(migrated, launch=launches)
    job_id = cut_off_by_a_reboot(first.test_client(), host, db)
    first.extensions["lora_worker"].db.dispose()
    output = host.dataset.parent / "output"
    corrupt_archive(output / "ohwx_lora-step00000004-state")
    app = create_app(migrated.with_overrides(auto_resume=True), launch=launches)  # raised RuntimeError before
    try:
        assert repo.get_job(db, job_id).failure_class == FailureClass.HOST_REBOOTED.value
        resumed = repo.get_job(db, job_id + 1)
        assert (resumed.resumed_from, resumed.resume_step) == (job_id, 2) and launches == [job_id, job_id + 1]
        assert app.test_client().get("/healthz").status_code == 200
    finally:
        app.extensions["lora_worker"].db.dispose()


def test_after_a_reboot_with_every_state_corrupt_the_job_is_marked_not_resumable(migrated, host, db, launches):
    from lora_worker import create_app

    first = create_app(migrated, launch=launches)
    job_id = cut_off_by_a_reboot(first.test_client(), host, db)
    first.extensions["lora_worker"].db.dispose()
    output = host.dataset.parent / "output"
    for step in (2, 4):
        corrupt_archive(output / f"ohwx_lora-step{step:08d}-state", "scheduler.bin", "method", 99)
    app = create_app(migrated.with_overrides(auto_resume=True), launch=launches)
    try:
        notes = [e.reason or "" for e in repo.job_events(db, job_id) if (e.reason or "").startswith("resume: ")]
        assert len(notes) == 1 and notes[0].startswith("resume: not resumable (state_archive_corrupt: ")
        assert job_rows(host.settings) == 1 and app.test_client().get("/healthz").status_code == 200
    finally:
        app.extensions["lora_worker"].db.dispose()

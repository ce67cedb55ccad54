"""`auto_resume`: reconcile resumes a job a reboot cut off, once, and says so; off, it only marks it resumable.
A resume's own failures never loop."""
from __future__ import annotations

import sqlite3

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.states import FailureClass, JobState
from tests.helpers import job_rows
from tests.helpers.states import cut_off_by_a_reboot, interrupted

AUTO = "lora_worker.config_settings"


def worker_of(app):
    return app.extensions["lora_worker"]


@pytest.fixture
def app_with(migrated, launches):
    from lora_worker import create_app

    made = []

    def make(**overrides):
        application = create_app(migrated.with_overrides(**overrides), launch=launches)
        made.append(application)
        return application
    yield make
    for application in made:
        worker_of(application).db.dispose()


def reasons(db, job_id: int) -> list[str]:
    return [e.reason or "" for e in repo.job_events(db, job_id)]


def test_on_a_job_the_reboot_cut_off_is_resumed_once(app_with, host, db, launches):
    app = app_with(auto_resume=True)
    original = cut_off_by_a_reboot(app.test_client(), host, db)
    worker_of(app).reconcile_active()
    job = repo.get_job(db, original)
    assert (job.status, job.failure_class) == ("failed", FailureClass.HOST_REBOOTED.value)
    assert job_rows(host.settings) == 2
    new = repo.get_job(db, original + 1)
    assert (new.resumed_from, new.attempt, new.resume_step) == (original, 2, 4) and launches == [original, new.id]
    assert any(r.startswith(f"resume: auto_resume: resumed as job {new.id} from step 4") for r in reasons(db, original))
    worker_of(app).reconcile_active()
    assert job_rows(host.settings) == 2  # once


def test_off_the_job_is_only_marked_resumable(app_with, host, db, launches):
    app = app_with()
    assert worker_of(app).settings.auto_resume is False  # the default
    original = cut_off_by_a_reboot(app.test_client(), host, db)
    worker_of(app).reconcile_active()
    assert job_rows(host.settings) == 1 and launches == [original]
    marks = [r for r in reasons(db, original) if r.startswith("resume: ")]
    assert marks == [f"resume: resumable from step 4 ({host.settings.train_root}/t1/output/"
                     f"ohwx_lora-step00000004-state): POST /train/{original}/resume (auto_resume is off)"]
    worker_of(app).reconcile_active()
    assert len([r for r in reasons(db, original) if r.startswith("resume: ")]) == 1


def test_a_resume_the_reboot_cut_off_is_never_resumed_by_itself(app_with, host, db):
    app = app_with(auto_resume=True)
    client = app.test_client()
    original = cut_off_by_a_reboot(client, host, db)
    worker_of(app).reconcile_active()
    resumed = original + 1
    repo.transition(db, resumed, JobState.RUNNING, actor="test")
    conn = sqlite3.connect(host.settings.database_path)
    with conn:
        conn.execute("UPDATE jobs SET boot_id = 'another-boot' WHERE id = ?", (resumed,))
    conn.close()
    worker_of(app).reconcile_active()
    assert repo.get_job(db, resumed).failure_class == FailureClass.HOST_REBOOTED.value
    assert job_rows(host.settings) == 2
    assert any("is itself a resume: never resumed automatically" in r for r in reasons(db, resumed))


def test_the_start_up_reconcile_resumes(app_with, host, db):
    first = app_with()
    original = cut_off_by_a_reboot(first.test_client(), host, db)
    assert repo.fail_job(db, original, actor="cli", failure_class=FailureClass.HOST_REBOOTED, sentence="rebooted")
    app_with(auto_resume=True)  # the web process starting after the boot's `lora-worker reconcile`
    assert repo.get_job(db, original + 1).resumed_from == original


def test_a_job_not_cut_off_by_a_reboot_is_not_looked_at(app_with, host, db):
    app = app_with(auto_resume=True)
    client = app.test_client()
    original = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
    interrupted(db, host.settings, original, failure=FailureClass.KILLED_BY_SIGNAL)
    worker_of(app).reconcile_active()
    assert job_rows(host.settings) == 1 and not any(r.startswith("resume: ") for r in reasons(db, original))

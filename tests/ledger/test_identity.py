"""The ledger is the one it claims to be: the file the service opened, with job ids that are never reused."""
from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from datetime import timedelta

import pytest

from lora_worker.errors import LedgerBusy, LedgerReplaced, LedgerUnwritable
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import migrate, seed_job_ids, upgrade
from lora_worker.ledger.models import utcnow
from lora_worker.ops.retention import prune
from lora_worker.transcript.logfile import JobLog, log_paths
from lora_worker.states import JobState
from tests.helpers.ledger import columns


def finished_job(db: Database) -> int:
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.FAILED, actor="supervisor", failure_class="trainer_crashed")
    return job.id


def old_failed_job(path: Path) -> int:
    """A failed job and its event, written as an older ledger holds them."""
    from tests.helpers.ledger import old_row

    job_id = old_row(path, "failed")
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("INSERT INTO job_events (job_id, at, from_status, to_status, actor) "
                     "VALUES (?, '2026-12-01T10:01:00.000Z', 'running', 'failed', 'supervisor')", (job_id,))
    conn.close()
    return job_id


# -- the file the service opened -------------------------------------------------------------------------------

def test_a_healthy_ledger_is_ok_in_healthz(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.get_json()["ledger"] == "ok"


def test_a_ledger_deleted_under_the_service_fails_healthz_and_every_write(client, app, migrated):
    db = app.extensions["lora_worker"].db
    job_id = finished_job(db)
    migrated.database_path.unlink()
    health = client.get("/healthz")
    body = health.get_json()  # the one error shape, what /healthz saw in details
    assert health.status_code == 503 and (body["error"], body["status"], body["retryable"]) == (
        "ledger_replaced", 503, False)
    assert body["details"]["health"] == "failing" and "deleted" in body["details"]["ledger"]
    assert "deleted" in body["message"]
    response = client.post(f"/train/{job_id}/cancel")
    assert response.status_code == 503 and response.get_json()["error"] == "ledger_replaced"
    with pytest.raises(LedgerReplaced):
        repo.create_job(db, columns())
    assert not migrated.database_path.exists()  # nothing recreated an empty ledger at the path either


def test_a_ledger_replaced_under_the_service_is_never_written_nor_read_as_ours(client, app, migrated, tmp_path):
    db = app.extensions["lora_worker"].db
    finished_job(db)
    stranger = tmp_path / "other.sqlite3"
    upgrade(stranger)
    before = stranger.read_bytes()
    shutil.move(stranger, migrated.database_path)  # a restore by `mv`: another inode at the same path
    health = client.get("/healthz")
    assert health.status_code == 503 and "replaced" in health.get_json()["details"]["ledger"]
    assert client.get("/train").status_code == 503
    with pytest.raises(LedgerReplaced):
        repo.create_job(db, columns())
    with pytest.raises(LedgerReplaced):
        repo.get_job(db, 1)
    assert migrated.database_path.read_bytes() == before


def test_a_replaced_ledger_is_not_an_error_the_supervisor_waits_out(migrated):
    # The supervisor retries LedgerBusy and LedgerUnwritable forever; this one must end its run instead.
    assert not issubclass(LedgerReplaced, (LedgerBusy, LedgerUnwritable))


def test_the_same_file_rewritten_in_place_is_still_the_ledger(db, migrated):
    finished_job(db)
    conn = sqlite3.connect(migrated.database_path)
    conn.execute("VACUUM")  # rewrites the file's pages, keeps its inode
    conn.close()
    assert db.identity_problem() is None
    finished_job(db)


# -- job ids are never reused ----------------------------------------------------------------------------------

def test_job_ids_are_never_reused_after_prune(db, migrated):
    ids = [finished_job(db) for _ in range(3)]
    pruned = prune(db, migrated, older_than_days=0, now=utcnow() + timedelta(days=1))
    assert pruned.job_ids == ids and repo.list_jobs(db, status=[], limit=10, before_id=None) == []
    assert finished_job(db) == ids[-1] + 1


def test_job_ids_are_never_reused_after_the_newest_row_is_deleted(db, migrated):
    ids = [finished_job(db) for _ in range(2)]
    repo.delete_jobs(db, [ids[-1]])
    assert finished_job(db) == ids[-1] + 1


def test_a_recreated_ledger_continues_above_every_job_that_left_a_run_log(migrated):
    migrated.log_dir.mkdir(parents=True, exist_ok=True)
    (migrated.log_dir / "job-41.log").write_text("a job of the old ledger\n")
    (migrated.log_dir / "job-7.tail.log").write_text("")
    migrated.database_path.unlink()  # the ledger is lost; its run logs are not
    assert migrate(migrated) == 41
    db = Database.open(migrated.database_path)
    try:
        assert finished_job(db) == 42
        assert seed_job_ids(migrated) == 42  # run again (every start): it never lowers the sequence
    finally:
        db.dispose()


def test_migration_0007_keeps_every_row_and_id_and_continues_above_them(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0006")  # the ledger just before 0007
    db = Database.open(path)
    ids = [old_failed_job(path) for _ in range(3)]  # by SQL: the models know later columns (0009's)
    events = len(repo.job_events(db, ids[0]))
    repo.delete_jobs(db, [ids[-1]])  # before 0007, this id would be handed out again
    db.dispose()
    upgrade(path)
    db = Database.open(path)
    try:
        assert [j.id for j in repo.list_jobs(db, status=[], limit=10, before_id=None)] == ids[:2][::-1]
        assert len(repo.job_events(db, ids[0])) == events
        assert finished_job(db) == ids[1] + 1
        conn = sqlite3.connect(path)
        assert conn.execute("SELECT count(*) FROM sqlite_sequence WHERE name = 'jobs'").fetchone() == (1,)
        assert "AUTOINCREMENT" in conn.execute("SELECT sql FROM sqlite_master WHERE name = 'jobs'").fetchone()[0]
        conn.close()
    finally:
        db.dispose()


# -- a run log belongs to one job -------------------------------------------------------------------------------

def test_a_run_log_is_never_appended_to_by_a_later_job_with_the_same_id(tmp_path):
    first = JobLog(tmp_path, 5, head_bytes=1 << 20, tail_bytes=1 << 20)
    first.note("the first job 5")
    first.close()
    second = JobLog(tmp_path, 5, head_bytes=1 << 20, tail_bytes=1 << 20)
    second.note("another job 5")
    second.close()
    head, _ = log_paths(tmp_path, 5)
    assert head.read_text() == "[lora-worker] another job 5\n"
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("job-5.log.replaced-")]
    assert kept.read_text() == "[lora-worker] the first job 5\n"


def test_a_run_log_path_planted_as_a_link_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("not a log\n")
    head, _ = log_paths(tmp_path / "logs", 9)
    head.parent.mkdir()
    head.symlink_to(target)
    log = JobLog(tmp_path / "logs", 9, head_bytes=1 << 20, tail_bytes=1 << 20)
    log.note("job 9")
    log.close()
    assert target.read_text() == "not a log\n" and head.read_text() == "[lora-worker] job 9\n"

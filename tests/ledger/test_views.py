"""The operator views (migration 0003): columns, durations from the stored text, read-only, and docs/ledger.md's
queries run as written."""
from __future__ import annotations

import re
import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest
from alembic import command
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, event

from lora_worker.config import REPO_ROOT
from lora_worker.ledger import repository as repo
from lora_worker.ledger.migrate import alembic_config, allow_batch_rename, head_revision
from lora_worker.states import JobState
from tests.helpers.ledger import columns

COLUMNS = {
    "v_jobs": ["id", "status", "phase", "tier", "device_index", "train_id", "output_name", "step", "total_steps",
               "pct", "created_at", "started_at", "finished_at", "queued_s", "run_s", "run_time", "total_s",
               "failure_class", "exit_code", "signal", "cancel_requested_at", "lora_path", "lora_sha256",
               "lora_size", "idempotency_key"],
    "v_active": ["id", "status", "phase", "tier", "device_index", "train_id", "output_name", "step", "total_steps",
                 "pct", "steps_per_s", "loss", "eta_s", "eta_basis", "created_at", "started_at",
                 "last_progress_at", "elapsed_s", "silent_s", "cancel_requested_at", "supervisor_pid",
                 "trainer_pid"],
    "v_failures": ["id", "failure_class", "error_summary", "exit_code", "signal", "tier", "device_index",
                   "train_id", "output_name", "step", "total_steps", "started_at", "finished_at", "failed_by",
                   "failed_because", "error"],
    "v_events": ["job_id", "at", "from_status", "to_status", "actor", "reason"],
    "schema_version": ["revision"],
}


def query(path: Path, sql: str, *params: object) -> list[sqlite3.Row]:
    """As an operator would: a read-only connection, nothing but SQL."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


@pytest.fixture
def ledger(db) -> dict[str, int]:
    """A succeeded job (waited 10 s, ran 10 min), an OOM, a reconciled one, and one running at step 100/400."""
    ok = repo.create_job(db, columns())
    repo.transition(db, ok.id, JobState.RUNNING, actor="supervisor", started_at=ok.created_at + timedelta(seconds=10))
    repo.transition(db, ok.id, JobState.SUCCEEDED, actor="supervisor", reason="LoRA verified",
                    finished_at=ok.created_at + timedelta(seconds=610), lora_path="/train/t1/output/ohwx.safetensors")
    oom = repo.create_job(db, columns())
    repo.transition(db, oom.id, JobState.RUNNING, actor="supervisor")
    repo.transition(db, oom.id, JobState.FAILED, actor="supervisor", reason="trainer exited 1",
                    failure_class="cuda_oom", exit_code=1,
                    error="CUDA ran out of memory at step 3.\ntorch.OutOfMemoryError: CUDA out of memory")
    lost = repo.create_job(db, columns())
    repo.transition(db, lost.id, JobState.RUNNING, actor="supervisor")
    repo.transition(db, lost.id, JobState.FAILED, actor="reconcile", reason="the supervisor died",
                    failure_class="supervisor_lost", error="The supervisor died.")
    running = repo.create_job(db, columns())
    repo.transition(db, running.id, JobState.RUNNING, actor="supervisor", phase="training")
    repo.update_running(db, running.id, step=100, rate=1.23456, loss=0.1, last_progress_at=running.created_at)
    return {"ok": ok.id, "oom": oom.id, "lost": lost.id, "running": running.id}


def test_every_view_has_the_documented_columns(migrated):
    for view, expected in COLUMNS.items():
        names = [row["name"] for row in query(migrated.database_path, f"PRAGMA table_info({view})")]
        assert names == expected, view


def test_v_jobs_shows_waiting_running_and_total_time_from_the_stored_timestamps(migrated, ledger):
    (row,) = query(migrated.database_path, "SELECT * FROM v_jobs WHERE id = ?", ledger["ok"])
    assert (row["status"], row["queued_s"], row["run_s"], row["run_time"], row["total_s"]) == (
        "succeeded", 10.0, 600.0, "0:10:00", 610.0)
    assert row["created_at"].endswith("Z") and row["lora_path"] == "/train/t1/output/ohwx.safetensors"
    assert len(query(migrated.database_path, "SELECT * FROM v_jobs")) == 4


def test_v_active_lists_only_the_active_job_with_its_progress(migrated, ledger):
    rows = query(migrated.database_path, "SELECT * FROM v_active")
    assert [r["id"] for r in rows] == [ledger["running"]]
    (row,) = rows
    assert (row["phase"], row["step"], row["pct"], row["steps_per_s"]) == ("training", 100, 25.0, 1.235)
    assert row["elapsed_s"] >= 0 and row["silent_s"] >= 0


def test_v_failures_gives_the_class_the_first_error_line_and_who_failed_it(migrated, ledger):
    rows = {r["id"]: r for r in query(migrated.database_path, "SELECT * FROM v_failures")}
    assert set(rows) == {ledger["oom"], ledger["lost"]}
    oom, lost = rows[ledger["oom"]], rows[ledger["lost"]]
    assert (oom["failure_class"], oom["error_summary"], oom["exit_code"], oom["failed_by"]) == (
        "cuda_oom", "CUDA ran out of memory at step 3.", 1, "supervisor")
    assert "torch.OutOfMemoryError" in oom["error"]
    assert (lost["failure_class"], lost["failed_by"], lost["failed_because"]) == (
        "supervisor_lost", "reconcile", "the supervisor died")


def test_v_events_is_a_jobs_history_in_order(migrated, ledger):
    rows = query(migrated.database_path, "SELECT from_status, to_status, actor FROM v_events WHERE job_id = ?",
                 ledger["ok"])
    assert [tuple(r) for r in rows] == [(None, "queued", "api"), ("queued", "running", "supervisor"),
                                        ("running", "succeeded", "supervisor")]


def test_schema_version_is_visible_from_sqlite3(migrated):
    assert [tuple(r) for r in query(migrated.database_path, "SELECT * FROM schema_version")] == [(head_revision(),)]


def test_the_views_are_read_only(migrated, ledger):
    conn = sqlite3.connect(migrated.database_path)
    try:
        for statement in ("INSERT INTO v_jobs (id) VALUES (99)", "UPDATE v_active SET step = 0",
                          "DELETE FROM v_failures"):
            with pytest.raises(sqlite3.OperationalError, match="cannot modify"):
                conn.execute(statement)
    finally:
        conn.close()


def test_the_views_survive_a_batch_migration_that_recreates_jobs(migrated, ledger):
    engine = create_engine(f"sqlite:///{migrated.database_path}")
    event.listen(engine, "connect", allow_batch_rename)  # as migrations/env.py connects
    with engine.begin() as conn, Operations(MigrationContext.configure(conn)).batch_alter_table(
            "jobs", recreate="always") as batch:
        batch.alter_column("trigger", existing_nullable=False, nullable=False)
    engine.dispose()
    assert [r["id"] for r in query(migrated.database_path, "SELECT id FROM v_active")] == [ledger["running"]]
    assert len(query(migrated.database_path, "SELECT * FROM v_jobs")) == 4


def test_downgrade_removes_the_views_and_upgrade_brings_them_back(migrated):
    views = "SELECT name FROM sqlite_master WHERE type = 'view' ORDER BY name"
    command.downgrade(alembic_config(migrated.database_path), "0002")
    assert query(migrated.database_path, views) == []
    command.upgrade(alembic_config(migrated.database_path), "head")
    assert [r["name"] for r in query(migrated.database_path, views)] == sorted(COLUMNS)


def ledger_doc_queries() -> list[str]:
    section = (REPO_ROOT / "docs" / "ledger.md").read_text()  # the views' queries and the webhook outbox's
    sql = "\n".join(line for block in re.findall(r"```sql\n(.*?)```", section, re.S)
                    for line in block.splitlines() if not line.lstrip().startswith("--"))
    return [q.strip() for q in sql.split(";") if q.strip()]


def test_the_ledger_doc_queries_run_as_written(migrated, ledger):
    queries = ledger_doc_queries()
    assert len(queries) >= 5
    for sql in queries:
        query(migrated.database_path, sql)  # raises on any error

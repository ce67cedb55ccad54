"""Migration 0015: the index the web's every reconcile reads the jobs a reboot cut off through; up, down, up."""
from __future__ import annotations

from alembic import command
from sqlalchemy.dialects import sqlite

from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import alembic_config, upgrade
from lora_worker.ledger.resumes import cut_off_query
from tests.helpers.ledger import add_later_columns, columns, sql, triggers

INDEX = "ix_jobs_status_failure_class"


def plan(path) -> str:
    query = cut_off_query(20).compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True})
    return "\n".join(row[-1] for row in sql(path, f"EXPLAIN QUERY PLAN {query}"))


def indexes(path) -> set[str]:
    return {name for (name,) in sql(path, "SELECT name FROM sqlite_master WHERE type = 'index'")}


def test_the_cut_off_jobs_are_read_through_the_index_not_every_failed_row(tmp_path):
    """Without it the query searched ix_jobs_status_id (status=?) and read each failed row for its class: 23 ms
    a call at 100,000 jobs, on every start-up and /metrics scrape."""
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0014")
    add_later_columns(path)
    assert f"INDEX {INDEX}" not in plan(path) and "USING INDEX ix_jobs_status_id (status=?)" in plan(path)
    upgrade(path, "0015")
    add_later_columns(path)
    assert f"SEARCH jobs USING INDEX {INDEX} (status=? AND failure_class=?)" in plan(path)


def test_up_down_up_keeps_rows_and_triggers(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0014")
    add_later_columns(path)
    before = triggers(path)
    upgrade(path, "0015")
    add_later_columns(path)
    assert INDEX in indexes(path) and triggers(path) == before
    db = Database.open(path)
    try:
        job = repo.create_job(db, columns())
    finally:
        db.dispose()
    command.downgrade(alembic_config(path), "0014")
    assert INDEX not in indexes(path) and triggers(path) == before
    assert sql(path, "SELECT id, status FROM jobs") == [(job.id, job.status)]
    upgrade(path, "0015")
    add_later_columns(path)
    assert INDEX in indexes(path) and sql(path, "SELECT id, status FROM jobs") == [(job.id, job.status)]

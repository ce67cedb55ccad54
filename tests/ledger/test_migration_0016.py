"""Migration 0016: the dataset lint's warnings kept with each job, added in place (0008's triggers and AUTOINCREMENT
kept); up, down, up."""
from __future__ import annotations

from alembic import command

from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import alembic_config, upgrade
from tests.helpers.ledger import add_later_columns, columns, sql, triggers


def names(path) -> set[str]:
    return {row[1] for row in sql(path, "PRAGMA table_info(jobs)")}


def test_up_down_up_keeps_rows_triggers_and_ids(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0015")
    before = triggers(path)
    upgrade(path, "0016")
    assert "dataset_warnings" in names(path) and triggers(path) == before
    add_later_columns(path)  # today's ORM names 0017's columns too
    db = Database.open(path)
    try:
        warned = '[{"code": "image_small", "severity": "warning", "file": "10_x/a.png", "message": "m"}]'
        job = repo.create_job(db, columns(dataset_warnings=warned))
        assert repo.get_job(db, job.id).dataset_warnings == warned
    finally:
        db.dispose()
    command.downgrade(alembic_config(path), "0015")
    assert "dataset_warnings" not in names(path) and triggers(path) == before
    assert sql(path, "SELECT count(*) FROM jobs") == [(1,)]
    upgrade(path, "0016")
    assert sql(path, "SELECT id, dataset_warnings FROM jobs") == [(job.id, None)]
    assert "AUTOINCREMENT" in sql(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'")[0][0]

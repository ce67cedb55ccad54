"""Migration 0014: the resume columns, added in place (0008's triggers and AUTOINCREMENT kept); up, down, up."""
from __future__ import annotations

from alembic import command

from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import alembic_config, upgrade
from tests.helpers.ledger import add_later_columns, columns, sql, triggers

NEW = {"resumed_from", "attempt", "resume_step", "base_model_identity"}


def names(path) -> set[str]:
    return {row[1] for row in sql(path, "PRAGMA table_info(jobs)")}


def test_up_down_up_keeps_rows_triggers_and_ids(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0013")
    before = triggers(path)
    upgrade(path, "0014")
    add_later_columns(path)
    assert names(path) >= NEW and triggers(path) == before
    assert "AUTOINCREMENT" in sql(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'")[0][0]
    db = Database.open(path)
    try:
        job = repo.create_job(db, columns())
        again = repo.create_job(db, columns(slot="slurm-1", resumed_from=job.id, attempt=2, resume_step=4,
                                            lora_file="/train/t1/output/other.safetensors"))
        assert (repo.get_job(db, job.id).attempt, repo.get_job(db, job.id).resume_step) == (1, 0)
        assert (again.resumed_from, again.attempt) == (job.id, 2)
    finally:
        db.dispose()
    command.downgrade(alembic_config(path), "0013")
    assert not NEW & names(path) and triggers(path) == before
    assert sql(path, "SELECT count(*) FROM jobs") == [(2,)]
    sql(path, "DELETE FROM jobs WHERE id = ?", again.id)
    upgrade(path, "0014")
    add_later_columns(path)
    db = Database.open(path)
    try:
        assert repo.create_job(db, columns(slot="slurm-2", lora_file="/x.safetensors")).id == again.id + 1
    finally:
        db.dispose()

"""At most one active job per LoRA file: with several Slurm slots, a second request naming the same output dir
and name is a 409 job_active naming the first job (a second save would overwrite its verified LoRA)."""
from __future__ import annotations

import sqlite3

import pytest
from alembic import command

from lora_worker.ledger.migrate import alembic_config, upgrade
from tests.slurm.fakes import SlurmWorker


def test_two_posts_for_one_lora_file_the_second_is_409_naming_the_first(slurm: SlurmWorker):
    first = slurm.submit(0)
    answer = slurm.client.post("/train", json=slurm.host.payload(output_dir=first.output_dir))
    assert answer.status_code == 409, answer.get_json()
    body = answer.get_json()
    assert body["error"] == "job_active" and body["details"]["active_job_id"] == first.id, body
    assert str(first.id) in body["message"] and first.lora_file in body["message"]
    assert len(slurm.scheduler.scripts) == 1  # nothing else was submitted
    assert slurm.client.post("/train", json=slurm.host.payload(
        output_dir=first.output_dir, output_name="another")).status_code == 202  # another file: its own slot


def test_once_the_holder_ended_the_same_lora_file_may_be_asked_for_again(slurm: SlurmWorker):
    first = slurm.submit(0)
    assert slurm.client.post(f"/train/{first.id}/cancel").status_code == 202
    slurm.scheduler.set(first.slurm_job_id, "CANCELLED", detail="CANCELLED by 0")
    slurm.cycles(2)
    assert slurm.job(first.id).status == "cancelled"
    answer = slurm.client.post("/train", json=slurm.host.payload(output_dir=first.output_dir))
    assert answer.status_code == 202, answer.get_json()


def indexes(path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    finally:
        conn.close()


def objects(path) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT type, name, sql FROM sqlite_master WHERE type IN ('trigger', 'table') "
                            "ORDER BY type, name").fetchall()
    finally:
        conn.close()


def test_migration_0011_up_down_up_adds_and_drops_only_the_index(tmp_path):
    db = tmp_path / "ledger.sqlite3"
    cfg = alembic_config(db)
    command.upgrade(cfg, "0010")
    before = objects(db)
    assert "one_active_job_per_lora" not in indexes(db)
    command.upgrade(cfg, "0011")
    assert "one_active_job_per_lora" in indexes(db) and objects(db) == before  # triggers, AUTOINCREMENT kept
    command.downgrade(cfg, "0010")
    assert "one_active_job_per_lora" not in indexes(db) and objects(db) == before
    upgrade(db, "0012")  # 0012's webhook tables and their triggers come on top, the rest as it was
    assert "one_active_job_per_lora" in indexes(db)
    def without_webhooks(found: list[tuple]) -> list[tuple]:  # 0012's tables, triggers and jobs' one column
        return [(kind, name, text.replace(", webhook_events TEXT", "")) for kind, name, text in found
                if "webhook" not in name]
    assert without_webhooks(objects(db)) == without_webhooks(before)


@pytest.mark.parametrize("status", ["queued", "running"])
def test_the_index_refuses_a_second_active_row_for_one_lora_file(tmp_path, status):
    from lora_worker.errors import JobActive
    from lora_worker.ledger import repository as repo
    from lora_worker.ledger.db import Database
    from tests.helpers.ledger import columns

    path = tmp_path / "ledger.sqlite3"
    upgrade(path)
    db = Database.open(path)
    try:
        one = repo.create_job(db, {**columns(), "slot": "slurm-0"})
        if status == "running":
            conn = sqlite3.connect(path)
            with conn:
                conn.execute("UPDATE jobs SET status = 'running' WHERE id = ?", (one.id,))
            conn.close()
        with pytest.raises(JobActive) as caught:
            repo.create_job(db, {**columns(), "slot": "slurm-1"})
        assert caught.value.details["active_job_id"] == one.id
    finally:
        db.dispose()

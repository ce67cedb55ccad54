"""Migration 0013: the `checkpoints` table, written with a running job's progress (both ledger paths), one row
per (job, kind, path) whatever is written again; up, down, up; rows go with their job."""
from __future__ import annotations

import sqlite3
from datetime import timedelta

import pytest
import sqlalchemy.exc
from alembic import command

from lora_worker.ledger import repository as repo
from lora_worker.ledger.checkpoints import LORA, STATE, CheckpointRow
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import alembic_config, upgrade
from lora_worker.ledger.statements import utcnow
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.states import FailureClass
from tests.helpers.ledger import running_job, sql, triggers

AT = utcnow()
SEEN = CheckpointRow(LORA, 150, "/o/ohwx-step00000150.safetensors", AT)
VERIFIED = CheckpointRow(LORA, 150, SEEN.path, AT, bytes=10, sha256="ab" * 32, verified=True)


def test_rows_are_written_with_the_progress_and_merged_by_path(db):
    job_id = running_job(db)
    ledger = SupervisorLedger(db.path)
    try:
        assert ledger.update_running(job_id, step=150, checkpoints=[SEEN])
        assert ledger.update_running(job_id, step=151, checkpoints=[VERIFIED])
        assert ledger.update_running(job_id, step=300, checkpoints=[SEEN])  # a re-read log: seen again
        removed = CheckpointRow(LORA, 150, SEEN.path, AT + timedelta(seconds=9), removed_at=AT)
        assert ledger.update_running(job_id, checkpoints=[removed, CheckpointRow(STATE, 150, "/o/s", AT)])
    finally:
        ledger.close()
    # the web's path reads what the supervisor's wrote
    [lora, state] = repo.get_job(db, job_id).checkpoints
    assert (lora.kind, lora.step, lora.bytes, lora.sha256, lora.verified, lora.removed_at) == (
        "lora", 150, 10, "ab" * 32, True, AT.replace(microsecond=AT.microsecond // 1000 * 1000))
    assert (state.kind, state.verified, state.removed_at) == ("state", None, None)


def test_a_finished_job_takes_no_checkpoint(db):
    job_id = running_job(db)
    assert repo.fail_job(db, job_id, actor="supervisor", failure_class=FailureClass.TRAINER_CRASHED, sentence="x")
    assert not repo.update_running(db, job_id, checkpoints=[SEEN])
    assert sql(db.path, "SELECT count(*) FROM checkpoints") == [(0,)]


def test_kind_is_lora_or_state_and_rows_go_with_their_job(db):
    job_id = running_job(db)
    with pytest.raises(sqlalchemy.exc.IntegrityError, match="CHECK"):
        repo.update_running(db, job_id, checkpoints=[CheckpointRow("model", 1, "/o/x", AT)])
    assert repo.update_running(db, job_id, checkpoints=[SEEN])
    conn = sqlite3.connect(db.path)
    try:
        with conn:
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))  # what prune does
        assert conn.execute("SELECT count(*) FROM checkpoints").fetchall() == [(0,)]
    finally:
        conn.close()


def test_up_down_up(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0012")
    before = triggers(path)
    upgrade(path)
    assert sql(path, "SELECT name FROM sqlite_master WHERE name = 'checkpoints'") == [("checkpoints",)]
    assert triggers(path) == before  # jobs is not rebuilt: 0008's and 0012's triggers as they were
    db = Database.open(path)
    try:
        job_id = running_job(db)
        assert repo.update_running(db, job_id, checkpoints=[SEEN])
    finally:
        db.dispose()
    command.downgrade(alembic_config(path), "0012")
    assert sql(path, "SELECT name FROM sqlite_master WHERE name LIKE '%checkpoints%'") == []
    assert sql(path, "SELECT count(*) FROM jobs") == [(1,)] and triggers(path) == before
    upgrade(path)
    assert sql(path, "SELECT count(*) FROM checkpoints") == [(0,)]

"""Migration 0010: the failure classes nan_loss and supervisor_signalled, on a rebuilt `jobs` that keeps 0007's
AUTOINCREMENT and 0008's count triggers; up, down (each row kept under an old class), and up again."""
from __future__ import annotations

import sqlite3

import pytest
from alembic import command

from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import alembic_config, upgrade
from lora_worker.states import FailureClass
from tests.helpers.ledger import columns
from tests.helpers.ledger import sql, triggers

DOWNGRADED = {"supervisor_signalled": "killed_by_signal", "nan_loss": "trainer_crashed"}


@pytest.mark.parametrize("failure", sorted(DOWNGRADED))
def test_up_down_up_keeps_rows_triggers_ids_and_counts(tmp_path, failure):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0009")
    before_triggers = triggers(path)
    upgrade(path)
    # 0008's triggers come through the rebuild word for word (0012's are on its own table, webhook_events)
    assert [t for t in triggers(path) if not t[0].startswith("webhook_")] == before_triggers
    assert "AUTOINCREMENT" in sql(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'")[0][0]
    db = Database.open(path)
    try:
        job = repo.create_job(db, columns())
        assert repo.fail_job(db, job.id, actor="supervisor", failure_class=FailureClass(failure), sentence="x")
        assert repo.counts(db).failures_by_class == {failure: 1}
    finally:
        db.dispose()
    command.downgrade(alembic_config(path), "0009")
    assert sql(path, "SELECT failure_class FROM jobs WHERE id = ?", job.id) == [(DOWNGRADED[failure],)]
    assert dict(sql(path, "SELECT label, n FROM job_counts WHERE metric = 'failure' AND n != 0")) == {
        DOWNGRADED[failure]: 1}
    assert sql(path, "SELECT label, n FROM job_counts WHERE metric = 'reconcile' AND n != 0") == []
    conn = sqlite3.connect(path)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"), conn:
            conn.execute("UPDATE jobs SET failure_class = ? WHERE id = ?", (failure, job.id))
    finally:
        conn.close()
    assert triggers(path) == before_triggers
    sql(path, "DELETE FROM jobs WHERE id = ?", job.id)  # the newest id, gone: only sqlite_sequence knows it
    upgrade(path)
    # 0008's triggers come through the rebuild word for word (0012's are on its own table, webhook_events)
    assert [t for t in triggers(path) if not t[0].startswith("webhook_")] == before_triggers
    db = Database.open(path)
    try:
        again = repo.create_job(db, columns())
        assert again.id == job.id + 1  # no id is handed out twice, across the rebuilds
        assert repo.fail_job(db, again.id, actor="supervisor", failure_class=FailureClass(failure), sentence="x")
        assert repo.counts(db).failures_by_class == {failure: 1}
    finally:
        db.dispose()

"""Migration 0009: the Slurm columns and failure classes, on a rebuilt `jobs` that keeps 0007's AUTOINCREMENT
(and the highest id ever given) and 0008's count triggers; and its downgrade."""
from __future__ import annotations

import sqlite3

import pytest
from alembic import command

from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import alembic_config, upgrade
from lora_worker.states import FailureClass, JobState
from tests.helpers.ledger import columns
from tests.helpers.ledger import old_row, sql, triggers

SLURM_CLASSES = ("out_of_memory", "time_limit", "node_fail", "slurm_lost")


def finished(db: Database, failure: str | None = None) -> int:
    job = repo.create_job(db, columns())
    if failure:
        assert repo.fail_job(db, job.id, actor="test", failure_class=FailureClass(failure), sentence="x")
    else:
        assert repo.transition(db, job.id, JobState.CANCELLED, actor="test")
    return job.id


def test_upgrade_adds_the_columns_keeps_rows_ids_triggers_and_the_highest_id(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0008")
    before_triggers = triggers(path)
    ids = [old_row(path, "cancelled") for _ in range(3)]
    sql(path, "DELETE FROM jobs WHERE id = ?", ids[-1])  # the highest id given is now only in sqlite_sequence
    counts_before = sql(path, "SELECT metric, label, n FROM job_counts ORDER BY 1, 2")
    upgrade(path, "0009")
    assert triggers(path) == before_triggers  # word for word: no count changes meaning
    assert "AUTOINCREMENT" in sql(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'")[0][0]
    assert sql(path, "SELECT id, backend, slurm_job_id, queue_reason FROM jobs ORDER BY id") == [
        (ids[0], "local", None, None), (ids[1], "local", None, None)]
    assert sql(path, "SELECT metric, label, n FROM job_counts ORDER BY 1, 2") == counts_before
    upgrade(path)  # the ORM knows the later revisions' columns; their rebuilds keep the highest id too
    db = Database.open(path)
    try:
        assert finished(db, "time_limit") == ids[-1] + 1  # the pruned id is not handed out again
        counted = dict(((m, label), n) for m, label, n in sql(path, "SELECT metric, label, n FROM job_counts"))
        assert counted[("failure", "time_limit")] == 1  # the recreated triggers count new rows
    finally:
        db.dispose()


@pytest.mark.parametrize("failure", SLURM_CLASSES)
def test_each_slurm_failure_class_is_accepted_after_and_refused_before(tmp_path, failure):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path)
    db = Database.open(path)
    job_id = finished(db, failure)
    db.dispose()
    command.downgrade(alembic_config(path), "0008")
    kept = sql(path, "SELECT failure_class FROM jobs WHERE id = ?", job_id)[0][0]
    assert kept == "killed_by_signal"  # a kill, which a new try may pass; never a reconcile class
    conn = sqlite3.connect(path)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"), conn:
            conn.execute("UPDATE jobs SET failure_class = ? WHERE id = ?", (failure, job_id))
    finally:
        conn.close()
    assert "backend" not in sql(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'")[0][0]
    assert [name for name, _ in triggers(path)] == sorted(
        ["job_counts_insert", "job_counts_update", "job_counts_delete", "job_counts_reconcile"])
    upgrade(path)  # and up again
    assert sql(path, "SELECT backend FROM jobs WHERE id = ?", job_id) == [("local",)]


def test_the_downgrade_of_a_job_slurm_lost_counts_no_reconcile_in_metrics(tmp_path):
    """/metrics' lora_worker_reconcile_actions counts jobs reconcile failed because their supervisor was gone. A job
    the poller (actor "slurm") failed as slurm_lost was no such thing, before or after the downgrade."""
    path = tmp_path / "ledger.sqlite3"
    upgrade(path)
    db = Database.open(path)
    try:
        job = repo.create_job(db, columns())
        assert repo.transition(db, job.id, JobState.RUNNING, actor="slurm")
        assert repo.fail_job(db, job.id, actor="slurm", failure_class=FailureClass.SLURM_LOST,
                             sentence="Slurm no longer knows job 7")
        assert repo.counts(db).reconcile_actions == {}
    finally:
        db.dispose()
    command.downgrade(alembic_config(path), "0008")
    assert sql(path, "SELECT label, n FROM job_counts WHERE metric = 'reconcile' AND n != 0") == []
    assert dict(sql(path, "SELECT label, n FROM job_counts WHERE metric = 'failure' AND n != 0")) == {
        "killed_by_signal": 1}
    sql(path, "DELETE FROM jobs WHERE id = ?", job.id)  # a prune after the downgrade leaves no count below zero
    assert sql(path, "SELECT metric, label, n FROM job_counts WHERE n < 0") == []

"""The ledger: schema = models, the one-active-job index, CAS transitions with events, BEGIN IMMEDIATE."""
from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy.exc
from alembic import command
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, event, select, update

from lora_worker.errors import JobActive, JobFinished
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import (alembic_config, allow_batch_rename, current_revision, head_revision,
                                        upgrade)
from lora_worker.ledger.models import Job
from lora_worker.states import JobState
from tests.helpers.ledger import columns


def raw(db: Database, sql: str, *params: object) -> list[tuple]:
    conn = sqlite3.connect(db.path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def test_upgrade_head_gives_the_schema_the_models_describe(migrated):
    assert current_revision(migrated.database_path) == head_revision()
    command.check(alembic_config(migrated.database_path))  # raises if autogenerate finds any difference


def index_sql(path: Path) -> str | None:
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT sql FROM sqlite_master WHERE type='index' AND name='one_active_job'").fetchone()
    finally:
        conn.close()
    return row[0] if row else None


def test_one_active_index_is_partial_unique_on_a_real_column_after_upgrade(migrated):
    sql = index_sql(migrated.database_path)
    assert sql == "CREATE UNIQUE INDEX one_active_job ON jobs (slot) WHERE status IN ('queued', 'running')"
    conn = sqlite3.connect(migrated.database_path)
    unique = {name: uniq for _, name, uniq, _, partial in conn.execute("PRAGMA index_list(jobs)")}
    assert unique["one_active_job"] == 1
    assert [r[2] for r in conn.execute("PRAGMA index_info(one_active_job)")] == ["slot"]
    conn.close()


def test_one_active_index_survives_a_batch_migration_that_recreates_the_table(migrated):
    # SQLAlchemy cannot reflect an expression index such as ((1)); a move-and-copy would drop it silently.
    engine = create_engine(f"sqlite:///{migrated.database_path}")
    event.listen(engine, "connect", allow_batch_rename)  # as migrations/env.py connects
    with engine.begin() as conn:
        ops = Operations(MigrationContext.configure(conn))
        with ops.batch_alter_table("jobs", recreate="always") as batch:
            batch.alter_column("trigger", existing_nullable=False, nullable=False)
    engine.dispose()
    assert "WHERE status IN ('queued', 'running')" in (index_sql(migrated.database_path) or "")


def test_second_active_job_is_refused_on_insert(db):
    first = repo.create_job(db, columns())
    with pytest.raises(JobActive) as refused:
        repo.create_job(db, columns(output_name="other"))
    assert refused.value.details["active_job_id"] == first.id
    assert raw(db, "SELECT count(*) FROM jobs") == [(1,)]


def test_second_active_job_is_refused_on_update(db):
    first = repo.create_job(db, columns())
    assert repo.transition(db, first.id, JobState.FAILED, actor="test")
    second = repo.create_job(db, columns())
    conn = sqlite3.connect(db.path)
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        conn.execute("UPDATE jobs SET status='running' WHERE id=?", (first.id,))
    conn.close()
    assert repo.get_job(db, second.id).status == "queued"


def test_status_check_refuses_values_outside_the_enum(db):
    job = repo.create_job(db, columns())
    conn = sqlite3.connect(db.path)
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        conn.execute("UPDATE jobs SET status='RUNNING' WHERE id=?", (job.id,))  # would dodge the partial index
    conn.close()


def test_transitions_are_compare_and_set_and_leave_events(db):
    job = repo.create_job(db, columns())
    assert not repo.transition(db, job.id, JobState.SUCCEEDED, actor="test")  # queued → succeeded: not allowed
    assert repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", reason="started")
    assert repo.transition(db, job.id, JobState.SUCCEEDED, actor="supervisor", reason="done")
    for late in JobState:
        assert not repo.transition(db, job.id, late, actor="stale"), f"terminal row moved to {late}"
    events = [(e.from_status, e.to_status, e.actor, e.reason) for e in repo.job_events(db, job.id)]
    assert events == [(None, "queued", "api", "accepted"), ("queued", "running", "supervisor", "started"),
                      ("running", "succeeded", "supervisor", "done")]


def test_a_stale_supervisor_cannot_write_progress_to_a_finished_row(db):
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    repo.transition(db, job.id, JobState.FAILED, actor="reconcile", failure_class="supervisor_lost")
    assert repo.update_running(db, job.id, step=99) is False
    assert repo.get_job(db, job.id).step == 0


def test_cancel_of_queued_job_cancels_it_at_once(db):
    job = repo.create_job(db, columns())
    after = repo.request_cancel(db, job.id, actor="api")
    assert after.status == "cancelled" and after.cancel_requested_at is not None


def test_cancel_of_running_job_sets_the_flag_once(db):
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    first = repo.request_cancel(db, job.id, actor="api")
    second = repo.request_cancel(db, job.id, actor="api")
    assert first.status == second.status == "running"
    assert first.cancel_requested_at == second.cancel_requested_at is not None
    flags = [e for e in repo.job_events(db, job.id) if e.reason == "cancel requested"]
    assert len(flags) == 1 and flags[0].from_status == flags[0].to_status == "running"


def test_cancel_of_finished_job_is_refused(db):
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.FAILED, actor="test")
    with pytest.raises(JobFinished):
        repo.request_cancel(db, job.id, actor="api")


def test_every_update_bumps_the_version(db):
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    repo.update_running(db, job.id, step=1)
    assert repo.get_job(db, job.id).version == job.version + 2


def test_timestamps_read_as_iso_utc_text_in_sqlite3(db):
    job = repo.create_job(db, columns())
    (created,) = raw(db, "SELECT created_at FROM jobs WHERE id=?", job.id)[0]
    assert created.endswith("Z") and created[10] == "T" and len(created) == 24
    assert raw(db, "SELECT julianday(created_at) > 0 FROM jobs") == [(1,)]


def test_every_write_path_runs_in_begin_immediate(db):
    statements: list[str] = []
    event.listen(db.writer, "before_cursor_execute",
                 lambda conn, cursor, statement, *a: statements.append(statement))
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    repo.update_running(db, job.id, step=3, points=[])
    repo.request_cancel(db, job.id, actor="api")
    writes = [i for i, s in enumerate(statements) if s.split()[0].upper() in ("INSERT", "UPDATE", "DELETE")]
    begins = [i for i, s in enumerate(statements) if s.upper().startswith("BEGIN")]
    assert begins and all(statements[i] == "BEGIN IMMEDIATE" for i in begins)
    # each write comes after a BEGIN IMMEDIATE of its own transaction (4 calls, 4 transactions)
    assert len(begins) == 4 and all(any(b < w for b in begins) for w in writes)


def _hammer(path: str, job_id: int, rounds: int, errors: multiprocessing.Queue) -> None:
    db = Database.open(Path(path), busy_timeout_s=10)
    failures = 0
    for i in range(rounds):
        try:
            # Read, then write, in one transaction: the pattern that fails at once under a plain BEGIN.
            with db.write() as s:
                step = s.scalar(select(Job.step).where(Job.id == job_id))
                s.execute(update(Job).where(Job.id == job_id).values(step=step + 1))
            repo.request_cancel(db, job_id, actor=f"p{i}")
        except (sqlalchemy.exc.OperationalError, Exception) as exc:  # noqa: BLE001 - counted, not hidden
            failures += 1
            errors.put(repr(exc))
    db.dispose()
    errors.put(failures)


@pytest.mark.slow
def test_two_processes_writing_concurrently_never_see_database_is_locked(db):
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    ctx = multiprocessing.get_context("spawn")
    errors: multiprocessing.Queue = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(db.path), job.id, 150, errors)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [errors.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert results == [0, 0], results
    assert repo.get_job(db, job.id).step == 300


def test_upgrading_from_the_first_revision_keeps_rows_and_the_index(tmp_path):
    path = tmp_path / "old.sqlite3"
    upgrade(path, "0001")
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO jobs (status, train_id, dataset_dir, base_model_path, output_dir, output_name, trigger, "
                 "subject_class, repeats, tier, device_index, seed, image_count, argv, env, total_steps, created_at, "
                 "updated_at) VALUES ('running','t1','/d','/m','/o','n','t','c',1,'fast',1,1,1,'[]','{}',400,"
                 "'2026-11-30T00:00:00.000Z','2026-11-30T00:00:00.000Z')")
    conn.commit()
    conn.close()
    upgrade(path)
    assert current_revision(path) == head_revision()
    assert "WHERE status IN ('queued', 'running')" in (index_sql(path) or "")
    db = Database.open(path)
    try:
        assert repo.get_job(db, 1).status == "running" and repo.get_job(db, 1).idempotency_key is None
        with pytest.raises(JobActive):
            repo.create_job(db, columns())
    finally:
        db.dispose()
    command.downgrade(alembic_config(path), "0001")
    assert current_revision(path) == "0001" and index_sql(path)


OLD_ROW = ("INSERT INTO jobs (status, train_id, dataset_dir, base_model_path, output_dir, output_name, trigger, "
           "subject_class, repeats, tier, device_index, seed, image_count, argv, env, total_steps, created_at, "
           "updated_at) VALUES (?, 't1', '/d', '/m', ?, ?, 't', 'c', 1, ?, 1, 1, 1, ?, '{}', 400, "
           "'2026-11-30T00:00:00.000Z', '2026-11-30T00:00:00.000Z')")


def _rows(path: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_0004_records_the_expected_lora_of_old_rows_from_their_argv_or_their_tier(tmp_path):
    path = tmp_path / "old.sqlite3"
    upgrade(path, "0003")
    conn = sqlite3.connect(path)
    # run with a rank and steps the tier never had: the argv is what the trainer was told, so it wins
    conn.execute(OLD_ROW, ("succeeded", "/train/t1/out", "first", "fast",
                           '["accelerate", "--network_dim=4", "--max_train_steps=3"]'))
    conn.execute(OLD_ROW, ("running", "/train/t1/out2", "second", "balanced", "[]"))
    conn.commit()
    conn.close()
    upgrade(path)
    assert _rows(path, "SELECT id, lora_file, lora_rank, lora_steps, lora_dtype FROM jobs ORDER BY id") == [
        (1, "/train/t1/out/first.safetensors", 4, 3, "F32"), (2, "/train/t1/out2/second.safetensors", 32, 1500, "F32")]
    command.check(alembic_config(path))
    conn = sqlite3.connect(path)
    try:
        # the rebuilt table still refuses what 0001 refused, and now a row without its expected LoRA
        with pytest.raises(sqlite3.IntegrityError, match="NOT NULL"):
            conn.execute(OLD_ROW, ("failed", "/o", "third", "fast", "[]"))
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            conn.execute("UPDATE jobs SET status='RUNNING' WHERE id=2")
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
            conn.execute("UPDATE jobs SET status='queued' WHERE id=1")  # the one-active-job index survived
        assert conn.execute("SELECT count(*) FROM v_failures").fetchone() == (0,)  # and so did the views
    finally:
        conn.close()
    command.downgrade(alembic_config(path), "0003")
    assert _rows(path, "SELECT id, status, output_name FROM jobs ORDER BY id") == [
        (1, "succeeded", "first"), (2, "running", "second")]

"""The supervisor's ledger path (stdlib sqlite3, ledger/supervisor.py) keeps every promise of the SQLAlchemy one:
the same columns and record, the same compare-and-set in BEGIN IMMEDIATE with its event row, the same text of a
failed row, the same busy and full errors, the file it was, and the job_counts triggers."""
from __future__ import annotations

import os
import sqlite3
from datetime import timedelta

import pytest

from lora_worker.errors import LedgerBusy, LedgerReplaced, LedgerUnwritable
from lora_worker.ledger import repository as repo
from lora_worker.ledger import statements
from lora_worker.ledger.models import Job
from lora_worker.ledger.supervisor import RECORD_COLUMNS, JobRecord, SupervisorLedger
from lora_worker.states import FailureClass, JobState
from tests.helpers import hold_exclusive
from tests.helpers.ledger import columns


@pytest.fixture
def ledger(migrated):
    opened = SupervisorLedger(migrated.database_path, busy_timeout_s=0.2, synchronous="NORMAL")
    yield opened
    opened.close()


def recording(seen: list[str], fail_on: str | None = None, error: str = "database or disk is full"):
    class Recording(sqlite3.Connection):
        def execute(self, sql, params=()):  # type: ignore[no-untyped-def, override]
            seen.append(sql)
            if fail_on and fail_on in sql:
                raise sqlite3.OperationalError(error)
            return super().execute(sql, params)

        def executemany(self, sql, rows):  # type: ignore[no-untyped-def, override]
            seen.append(sql)
            if fail_on and fail_on in sql:
                raise sqlite3.OperationalError(error)
            return super().executemany(sql, rows)
    return Recording


def test_the_record_reads_columns_of_jobs_and_the_json_ones_are_the_models():
    assert set(RECORD_COLUMNS) <= set(Job.__table__.c.keys())
    assert {c.name for c in Job.__table__.c if c.type.__class__.__name__ == "JSON"} == statements.JSON_COLUMNS


def test_the_record_is_the_row_as_the_orm_reads_it(db, ledger):
    job = repo.create_job(db, columns(estimated_duration_s=12.5, output_dev_ino="1:2"))
    record = ledger.find_job(job.id)
    orm = repo.get_job(db, job.id)
    assert isinstance(record, JobRecord)
    assert {c: getattr(record, c) for c in RECORD_COLUMNS} == {c: getattr(orm, c) for c in RECORD_COLUMNS}
    assert record.argv == ["accelerate", "launch"] and record.env == {"PATH": "/usr/bin"}
    assert ledger.find_job(job.id + 1) is None
    with pytest.raises(AttributeError):
        record.status = "running"  # type: ignore[misc]  # frozen: read once, never written back


def test_running_is_a_compare_and_set_from_queued_with_its_event(db, ledger):
    job = repo.create_job(db, columns())
    started = statements.utcnow()
    assert ledger.mark_running(job.id, started_at=started, supervisor_pid=4242, phase="launching")
    assert not ledger.mark_running(job.id, supervisor_pid=1)  # running → running is no transition: no write
    row = repo.get_job(db, job.id)
    assert (row.status, row.supervisor_pid, row.version) == ("running", 4242, 2)
    assert abs(row.started_at - started) < timedelta(milliseconds=1)  # the ORM reads the text it wrote
    event = repo.job_events(db, job.id)[-1]
    assert (event.from_status, event.to_status, event.actor, event.reason) == (
        "queued", "running", "supervisor", "supervisor started")


def test_a_job_that_left_the_queue_is_not_started(db, ledger):
    job = repo.create_job(db, columns())
    repo.request_cancel(db, job.id, actor="api")
    assert not ledger.mark_running(job.id, supervisor_pid=1)
    assert repo.get_job(db, job.id).status == "cancelled"


def test_progress_and_points_land_while_running_and_are_refused_after(db, ledger):
    job = repo.create_job(db, columns())
    ledger.mark_running(job.id)
    at = statements.utcnow()
    assert ledger.update_running(job.id, points=[(1, 0.5, at), (2, None, at)], step=2, loss=0.5,
                                 last_progress_at=at)
    assert ledger.update_running(job.id, points=[(2, 0.4, at + timedelta(seconds=3))])
    assert [(p.step, p.loss) for p in repo.progress_points(db, job.id)] == [(1, 0.5), (2, 0.4)]
    assert repo.progress_points(db, job.id)[1].at == repo.progress_points(db, job.id)[0].at  # first write's time
    assert (repo.get_job(db, job.id).step, repo.get_job(db, job.id).version) == (2, 4)
    repo.fail_job(db, job.id, actor="reconcile", failure_class=FailureClass.SUPERVISOR_LOST, sentence="gone")
    assert not ledger.update_running(job.id, step=3)
    assert repo.get_job(db, job.id).step == 2
    with pytest.raises(ValueError, match="not columns"):
        ledger.update_running(job.id, status="succeeded")  # the statement's own column, never a caller's
    with pytest.raises(ValueError, match="not columns"):
        ledger.update_running(job.id, **{"step = 0, status": "succeeded"})
    with pytest.raises(sqlite3.OperationalError, match="no such column"):
        ledger.update_running(job.id, no_such_column=1)
    assert repo.get_job(db, job.id).status == "failed"


def test_the_cancel_probe_sees_the_flag_and_the_state(db, ledger):
    job = repo.create_job(db, columns())
    ledger.mark_running(job.id)
    assert ledger.cancel_state(job.id) == ("running", False)
    repo.request_cancel(db, job.id, actor="api")
    assert ledger.cancel_state(job.id) == ("running", True)
    assert ledger.cancel_state(job.id + 1) == (None, False)


@pytest.mark.parametrize("end", ["succeeded", "cancelled", "failed"])
def test_each_end_is_written_once_with_its_event_and_no_eta_left(db, ledger, end):
    job = repo.create_job(db, columns())
    ledger.mark_running(job.id)
    ledger.update_running(job.id, eta_s=30.0, eta_basis="measured")
    write = {
        "succeeded": lambda: ledger.mark_succeeded(job.id, reason="verified", lora_sha256="ab" * 32, exit_code=0),
        "cancelled": lambda: ledger.mark_cancelled(job.id, reason="cancelled", exit_code=None),
        "failed": lambda: ledger.fail_job(job.id, failure_class=FailureClass.CUDA_OOM, sentence="CUDA ran out",
                                          log_lines=["a", "", "torch.OutOfMemoryError  "], exit_code=1),
    }[end]
    assert write()
    assert not write()  # a terminal row never moves again
    row = repo.get_job(db, job.id)
    assert (row.status, row.eta_s, row.eta_basis) == (end, None, None) and row.finished_at is not None
    events = [(e.to_status, e.actor) for e in repo.job_events(db, job.id)]
    assert events == [("queued", "api"), ("running", "supervisor"), (end, "supervisor")]
    if end == "failed":
        assert row.error == statements.failure_text("CUDA ran out", ["a", "torch.OutOfMemoryError"])
        assert row.error == "CUDA ran out.\n\na\ntorch.OutOfMemoryError" and row.failure_class == "cuda_oom"
        assert repo.job_events(db, job.id)[-1].reason == "CUDA ran out."


def test_both_paths_write_the_same_failed_row(db, ledger):
    lines = [f"line {i}" for i in range(40)]
    rows = []
    for path in ("web", "supervisor"):
        job = repo.create_job(db, columns(train_id=path))
        repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
        kwargs = dict(failure_class=FailureClass.TRAINER_CRASHED, sentence="The trainer failed (exit status 1)",
                      log_lines=lines, exit_code=1)
        if path == "web":
            assert repo.fail_job(db, job.id, actor="supervisor", **kwargs)
        else:
            assert ledger.fail_job(job.id, **kwargs)
        row = repo.get_job(db, job.id)
        rows.append((row.status, row.failure_class, row.error, row.exit_code, row.version,
                     repo.job_events(db, job.id)[-1].reason))
    assert rows[0] == rows[1]


def test_the_counts_triggers_fire_for_the_supervisors_writes(db, ledger):
    job = repo.create_job(db, columns())
    ledger.mark_running(job.id, started_at=statements.utcnow() - timedelta(seconds=5))
    assert repo.counts(db).by_status.get("running") == 1
    ledger.fail_job(job.id, failure_class=FailureClass.STALLED, sentence="no progress")
    counts = repo.counts(db)
    assert counts.by_status.get("failed") == 1 and counts.by_status.get("running", 0) == 0
    assert counts.failures_by_class == {"stalled": 1}
    assert counts.durations["failed"][1] == 1


def test_the_history_read_is_the_repositorys(db, ledger):
    start = statements.utcnow() - timedelta(minutes=5)
    for tail_s in (4.0, 6.0):
        job = repo.create_job(db, columns())
        repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", started_at=start)
        repo.update_running(db, job.id, points=[(400, 0.1, start + timedelta(seconds=60))])
        repo.transition(db, job.id, JobState.SUCCEEDED, actor="supervisor",
                        finished_at=start + timedelta(seconds=60 + tail_s))
    mine = ledger.save_and_teardown_durations(backend="local", tier="fast", device_index=1)
    assert mine == repo.save_and_teardown_durations(db, backend="local", tier="fast", device_index=1)
    assert mine == [pytest.approx(6.0, abs=0.01), pytest.approx(4.0, abs=0.01)]  # newest first
    assert ledger.save_and_teardown_durations(backend="local", tier="quality", device_index=1) == []


def test_every_write_begins_immediate_and_commits(migrated, db):
    job = repo.create_job(db, columns())
    seen: list[str] = []
    ledger = SupervisorLedger(migrated.database_path, connection_class=recording(seen))
    try:
        ledger.mark_running(job.id)
    finally:
        ledger.close()
    writes = [s for s in seen if not s.startswith("PRAGMA")]
    assert writes[0] == "BEGIN IMMEDIATE" and writes[-1] == "COMMIT"
    assert any(s.startswith("UPDATE jobs") for s in writes) and any("job_events" in s for s in writes)


def test_a_write_that_fails_halfway_leaves_nothing_and_says_unwritable(migrated, db):
    job = repo.create_job(db, columns())
    ledger = SupervisorLedger(migrated.database_path, connection_class=recording([], fail_on="INSERT INTO job_events"))
    try:
        with pytest.raises(LedgerUnwritable, match="database or disk is full"):
            ledger.mark_running(job.id, supervisor_pid=7)
    finally:
        ledger.close()
    row = repo.get_job(db, job.id)
    assert (row.status, row.supervisor_pid, row.version) == ("queued", None, 1)  # the UPDATE was rolled back


def test_a_locked_ledger_is_ledger_busy_and_the_next_try_lands(db, ledger):
    job = repo.create_job(db, columns())
    holder = hold_exclusive(db.path, 1.0)
    try:
        with pytest.raises(LedgerBusy):
            ledger.mark_running(job.id)
    finally:
        holder.join()
    assert ledger.mark_running(job.id)  # the same connection, usable again: nothing was left half-begun
    assert repo.get_job(db, job.id).status == "running"


def test_a_replaced_ledger_file_is_refused(migrated, db, ledger):
    job = repo.create_job(db, columns())
    assert ledger.find_job(job.id) is not None
    path = migrated.database_path
    os.rename(path, path.with_suffix(".old"))
    sqlite3.connect(path).close()  # a stranger's empty file at the ledger's path
    with pytest.raises(LedgerReplaced, match="was replaced"):
        ledger.mark_running(job.id)
    os.unlink(path)
    with pytest.raises(LedgerReplaced, match="was deleted"):
        ledger.find_job(job.id)

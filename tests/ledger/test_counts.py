"""The aggregates /metrics serves (`job_counts`, kept by triggers) always equal a scan of the history: through
every state change, a reconcile, a prune, rows written by hand with sqlite3, and a history migrated in."""
from __future__ import annotations

import importlib.util
import sqlite3
from datetime import timedelta
from pathlib import Path

from lora_worker.config import REPO_ROOT, Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import upgrade
from lora_worker.ledger.models import utcnow
from lora_worker.states import FailureClass, JobState
from lora_worker.web.metrics import DURATION_BUCKETS
from tests.helpers.ledger import columns

RECONCILED = ("supervisor_lost", "host_rebooted")


def scanned(path: Path) -> repo.Counts:
    """The same figures computed the slow way, from every row (what /metrics did before the triggers)."""
    conn = sqlite3.connect(path)
    try:
        by_status = dict(conn.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())
        failures = dict(conn.execute("SELECT coalesce(failure_class, 'None'), count(*) FROM jobs "
                                     "WHERE status = 'failed' GROUP BY 1").fetchall())
        runs = conn.execute(
            "SELECT status, max(0.0, (julianday(finished_at) - julianday(coalesce(started_at, created_at))) * 86400)"
            " FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled') AND finished_at IS NOT NULL").fetchall()
        actions = conn.execute(
            "SELECT e.actor, j.failure_class, count(*) FROM job_events e JOIN jobs j ON j.id = e.job_id "
            "WHERE e.to_status = 'failed' AND e.actor != 'supervisor' AND j.failure_class IN (?, ?) GROUP BY 1, 2",
            RECONCILED).fetchall()
        webhooks = conn.execute(
            "SELECT CASE WHEN state = 'pending' AND attempts > 0 THEN 'retrying' ELSE state END, count(*) "
            "FROM webhook_events GROUP BY 1").fetchall()
    finally:
        conn.close()
    durations: dict[str, tuple[list[tuple[float, int]], int, float]] = {}
    for status in {s for s, _ in runs}:
        seconds = [secs for s, secs in runs if s == status]
        buckets: dict[float, int] = {}
        for secs in seconds:
            bound = next((b for b in DURATION_BUCKETS if secs <= b), float("inf"))
            buckets[bound] = buckets.get(bound, 0) + 1
        durations[status] = (sorted(buckets.items()), len(seconds), sum(seconds))
    return repo.Counts(by_status=by_status, failures_by_class=failures, durations=durations,
                       reconcile_actions={(a, f): n for a, f, n in actions},
                       webhook_events=dict(webhooks))


def assert_counts_match(db: Database) -> None:
    kept, scan = repo.counts(db), scanned(db.path)
    assert kept.by_status == scan.by_status
    assert kept.failures_by_class == scan.failures_by_class
    assert kept.reconcile_actions == scan.reconcile_actions
    assert kept.durations.keys() == scan.durations.keys()
    for status, (buckets, count, seconds) in scan.durations.items():
        k_buckets, k_count, k_seconds = kept.durations[status]
        assert (k_buckets, k_count) == (buckets, count)
        assert abs(k_seconds - seconds) < 1e-3 * max(1.0, seconds)


def finished(db: Database, state: JobState, seconds: float, actor: str = "supervisor", **values: object) -> int:
    job = repo.create_job(db, columns(output_name=f"o{utcnow().timestamp()}"))
    start = utcnow() - timedelta(hours=5)
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", started_at=start)
    repo.transition(db, job.id, state, actor=actor, finished_at=start + timedelta(seconds=seconds), **values)
    return job.id


def test_the_counts_follow_every_change_of_a_job(db: Database):
    assert_counts_match(db)
    queued = repo.create_job(db, columns())
    assert repo.counts(db).by_status == {"queued": 1}
    repo.transition(db, queued.id, JobState.RUNNING, actor="supervisor", started_at=utcnow())
    assert repo.counts(db).by_status == {"running": 1}
    repo.transition(db, queued.id, JobState.SUCCEEDED, actor="supervisor")
    # Near both sides of bounds, not on them: the stored times are milliseconds, so an exact bound may land
    # either side of it after julianday's float arithmetic (assert_counts_match holds the bucketing to a scan).
    ids = [finished(db, JobState.SUCCEEDED, s) for s in (30, 59, 61, 14_000, 20_000)]
    ids.append(finished(db, JobState.FAILED, 700, failure_class=FailureClass.CUDA_OOM.value))
    ids.append(finished(db, JobState.FAILED, 5, actor="api", failure_class=FailureClass.SUPERVISOR_LOST.value))
    ids.append(finished(db, JobState.FAILED, 5, actor="startup", failure_class=FailureClass.HOST_REBOOTED.value))
    ids.append(finished(db, JobState.FAILED, 5, failure_class=FailureClass.SUPERVISOR_LOST.value))  # its own
    ids.append(finished(db, JobState.CANCELLED, 90))
    assert_counts_match(db)
    counts = repo.counts(db)
    assert counts.by_status == {"succeeded": 6, "failed": 4, "cancelled": 1}
    assert counts.reconcile_actions == {("api", "supervisor_lost"): 1, ("startup", "host_rebooted"): 1}
    succeeded = dict(counts.durations["succeeded"][0])
    assert succeeded[60.0] == 3  # ~0 s, 30 s and 59 s
    assert succeeded[300.0] == 1  # 61 s
    assert succeeded[14_400.0] == 1  # 14,000 s
    assert succeeded[float("inf")] == 1  # 20,000 s, past the largest bound


def test_a_prune_takes_its_jobs_out_of_the_counts(db: Database):
    ids = [finished(db, JobState.FAILED, 5, actor="api", failure_class=FailureClass.SUPERVISOR_LOST.value),
           finished(db, JobState.SUCCEEDED, 400), finished(db, JobState.CANCELLED, 10)]
    assert repo.delete_jobs(db, ids[:2]) == 2
    assert_counts_match(db)
    assert repo.counts(db).by_status == {"cancelled": 1}
    assert repo.counts(db).reconcile_actions == {}


def test_rows_written_by_hand_with_sqlite3_are_counted(db: Database):
    # Operators and the benchmarks write rows outside the repository; the triggers see them all the same.
    template = finished(db, JobState.SUCCEEDED, 100)
    conn = sqlite3.connect(db.path)
    try:
        cols = [c[1] for c in conn.execute("PRAGMA table_info(jobs)") if c[1] != "id"]
        select_cols = ", ".join(cols).replace("status", "'failed'", 1)
        with conn:
            conn.execute(f"INSERT INTO jobs ({', '.join(cols)}) SELECT {select_cols} FROM jobs WHERE id = ?",
                         (template,))
            conn.execute("UPDATE jobs SET failure_class = 'stalled' WHERE status = 'failed'")
    finally:
        conn.close()
    assert_counts_match(db)


def test_the_migration_counts_the_history_it_finds(settings: Settings):
    upgrade(settings.database_path, "0003")  # the ledger as it was before the counts existed
    conn = sqlite3.connect(settings.database_path)
    try:
        for i, (status, failure) in enumerate([("succeeded", None), ("failed", "cuda_oom"), ("failed", None),
                                              ("cancelled", None), ("running", None)]):
            conn.execute(
                "INSERT INTO jobs (slot, status, train_id, dataset_dir, base_model_path, output_dir, output_name, "
                "trigger, subject_class, repeats, tier, device_index, seed, image_count, argv, env, step, "
                "total_steps, failure_class, created_at, started_at, finished_at, updated_at, version) VALUES "
                "(?, ?, 't', '/d', '/m', '/o', ?, 'x', 'y', 1, 'fast', 1, 1, 1, '[]', '{}', 0, 400, ?, "
                "'2026-11-01T00:00:00.000Z', '2026-11-01T00:01:00.000Z', ?, '2026-11-01T00:00:00.000Z', 1)",
                (f"old{i}", status, f"n{i}", failure,
                 None if status == "running" else f"2026-11-01T00:{10 + i:02d}:00.000Z"))
        conn.execute("INSERT INTO job_events (job_id, at, from_status, to_status, actor, reason) "
                     "VALUES (2, '2026-11-01T00:10:00.000Z', 'running', 'failed', 'api', 'x')")
        conn.execute("UPDATE jobs SET failure_class = 'supervisor_lost' WHERE id = 3")
        conn.execute("INSERT INTO job_events (job_id, at, from_status, to_status, actor, reason) "
                     "VALUES (3, '2026-11-01T00:10:00.000Z', 'running', 'failed', 'cli', 'x')")
        conn.commit()
    finally:
        conn.close()
    upgrade(settings.database_path)
    db = Database.open(settings.database_path)
    try:
        assert_counts_match(db)
        assert repo.counts(db).reconcile_actions == {("cli", "supervisor_lost"): 1}
    finally:
        db.dispose()


def test_the_metrics_buckets_are_the_ones_the_migration_counts_into():
    path = REPO_ROOT / "migrations" / "versions" / "0008_job_counts.py"
    spec = importlib.util.spec_from_file_location("migration_0008", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert tuple(float(b) for b in module.BOUNDS) == DURATION_BUCKETS

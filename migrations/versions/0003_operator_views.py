"""Read-only views for operators at the sqlite3 prompt: v_jobs, v_active, v_failures, v_events, schema_version.

Durations are computed with julianday() on the stored ISO-8601 UTC text; timestamps are shown as stored.
The SQL is written out here rather than built from the code's constants, so this revision stays what it was.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""
from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _seconds(later: str, earlier: str) -> str:
    return f"round((julianday({later}) - julianday({earlier})) * 86400, 1)"


def _hms(later: str, earlier: str) -> str:
    """H:MM:SS, hours past 24 included (sqlite's time() would wrap)."""
    s = f"CAST(round((julianday({later}) - julianday({earlier})) * 86400) AS INTEGER)"
    return f"printf('%d:%02d:%02d', {s} / 3600, {s} % 3600 / 60, {s} % 60)"


NOW = "'now'"  # julianday('now') is UTC, like the stored text
PCT = "CASE WHEN total_steps > 0 THEN round(100.0 * step / total_steps, 1) END"
FIRST_LINE = "substr(j.error, 1, instr(j.error || char(10), char(10)) - 1)"

VIEWS = {
    # Every job, with how long it waited, ran and took in all (so far, for an active one).
    "v_jobs": f"""
        SELECT id, status, phase, tier, device_index, train_id, output_name, step, total_steps, {PCT} AS pct,
               created_at, started_at, finished_at,
               {_seconds(f"coalesce(started_at, finished_at, {NOW})", "created_at")} AS queued_s,
               CASE WHEN started_at IS NOT NULL
                    THEN {_seconds(f"coalesce(finished_at, {NOW})", "started_at")} END AS run_s,
               CASE WHEN started_at IS NOT NULL
                    THEN {_hms(f"coalesce(finished_at, {NOW})", "started_at")} END AS run_time,
               {_seconds(f"coalesce(finished_at, {NOW})", "created_at")} AS total_s,
               failure_class, exit_code, signal, cancel_requested_at, lora_path, lora_sha256, lora_size,
               idempotency_key
        FROM jobs""",
    # The job that is queued or running now: progress, speed, and how long since it last said anything.
    "v_active": f"""
        SELECT id, status, phase, tier, device_index, train_id, output_name, step, total_steps, {PCT} AS pct,
               round(rate, 3) AS steps_per_s, loss, eta_s, eta_basis, created_at, started_at, last_progress_at,
               {_seconds(NOW, "coalesce(started_at, created_at)")} AS elapsed_s,
               {_seconds(NOW, "coalesce(last_progress_at, started_at, created_at)")} AS silent_s,
               cancel_requested_at, supervisor_pid, trainer_pid
        FROM jobs WHERE status IN ('queued', 'running')""",
    # Failed jobs: the class, the first line of the error, and who failed it (supervisor, reconcile, …) why.
    "v_failures": f"""
        SELECT j.id, j.failure_class, {FIRST_LINE} AS error_summary, j.exit_code, j.signal, j.tier,
               j.device_index, j.train_id, j.output_name, j.step, j.total_steps, j.started_at, j.finished_at,
               e.actor AS failed_by, e.reason AS failed_because, j.error
        FROM jobs j
        LEFT JOIN job_events e ON e.id = (SELECT max(id) FROM job_events WHERE job_id = j.id AND to_status = 'failed')
        WHERE j.status = 'failed'""",
    # A job's history, one line per change.
    "v_events": """
        SELECT e.job_id, e.at, e.from_status, e.to_status, e.actor, e.reason
        FROM job_events e""",
    "schema_version": """
        SELECT version_num AS revision FROM alembic_version""",
}


def upgrade() -> None:
    for name, select in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")

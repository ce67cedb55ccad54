"""job_counts: the aggregates /metrics serves, kept by triggers as rows change, so a scrape reads a few dozen
rows instead of the whole history (`GET /metrics` went from 2 ms on an empty ledger to 131 ms at 100k jobs).

Each row is (metric, label, n):
- `status`, <status>: jobs in that status;
- `failure`, <failure_class>: failed jobs of that class;
- `duration_bucket`, `<status>|<bound>`: finished jobs whose run (start, or acceptance if it never started,
  to finish) took at most `<bound>` seconds and more than the next smaller bound; `+Inf` past the largest;
- `duration_sum`, <status>: their seconds added up;
- `reconcile`, `<actor>|<failure_class>`: jobs that reconcile (any actor but the supervisor) marked failed
  because their supervisor was gone (supervisor_lost) or the host rebooted (host_rebooted).
Counts cover the rows the ledger holds: `jobs prune` lowers them (the delete trigger), as before.

The SQL is written out here, bucket bounds included, so this revision stays what it was (a test holds the
bounds equal to /metrics'). A backfill counts what the ledger already holds. Triggers go with their table:
a later migration that rebuilds `jobs` or `job_events` (batch mode's copy and rename) must create them again.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BOUNDS = (60, 300, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200, 10800, 14400)  # seconds: minutes to hours
TERMINAL = "('succeeded', 'failed', 'cancelled')"
RECONCILED = "('supervisor_lost', 'host_rebooted')"


def _seconds(row: str) -> str:
    return (f"max(0.0, (julianday({row}.finished_at) - julianday(coalesce({row}.started_at, {row}.created_at)))"
            " * 86400.0)")


def _bucket(row: str) -> str:
    seconds = _seconds(row)
    whens = " ".join(f"WHEN {seconds} <= {b} THEN '{float(b)}'" for b in BOUNDS)
    return f"CASE {whens} ELSE '+Inf' END"


def _add(metric: str, label: str, n: str, where: str = "1") -> str:
    return (f"INSERT INTO job_counts (metric, label, n) SELECT '{metric}', {label}, {n} WHERE {where} "
            "ON CONFLICT (metric, label) DO UPDATE SET n = n + excluded.n;")


def _finished(row: str, sign: str) -> str:
    """What a row in a terminal state adds (sign '+') to the counts, or takes away ('-')."""
    done = f"{row}.status IN {TERMINAL} AND {row}.finished_at IS NOT NULL"
    return "\n".join([
        _add("failure", f"coalesce({row}.failure_class, 'None')", f"{sign}1", f"{row}.status = 'failed'"),
        _add("duration_bucket", f"{row}.status || '|' || {_bucket(row)}", f"{sign}1", done),
        _add("duration_sum", f"{row}.status", f"{sign}{_seconds(row)}", done),
    ])


def _reconciled(row: str, sign: str) -> str:
    """A job's reconcile actions (its `failed` events by anyone but the supervisor, when its class is one
    reconcile gives), added or taken away."""
    return (f"INSERT INTO job_counts (metric, label, n) SELECT 'reconcile', e.actor || '|' || {row}.failure_class, "
            f"{sign}count(*) FROM job_events e WHERE e.job_id = {row}.id AND e.to_status = 'failed' "
            f"AND e.actor != 'supervisor' AND {row}.failure_class IN {RECONCILED} GROUP BY e.actor "
            "ON CONFLICT (metric, label) DO UPDATE SET n = n + excluded.n;")


TRIGGERS = {
    "job_counts_insert": f"""
        CREATE TRIGGER job_counts_insert AFTER INSERT ON jobs BEGIN
            {_add("status", "NEW.status", "1")}
            {_finished("NEW", "+")}
        END""",
    # Anything a count depends on, changed by the worker (a state change) or by hand with sqlite3: take the
    # old row's share out and put the new row's in. Progress writes touch none of these columns.
    "job_counts_update": f"""
        CREATE TRIGGER job_counts_update AFTER UPDATE OF status, failure_class, created_at, started_at, finished_at
        ON jobs BEGIN
            {_add("status", "OLD.status", "-1")}
            {_add("status", "NEW.status", "1")}
            {_finished("OLD", "-")}
            {_finished("NEW", "+")}
            {_reconciled("OLD", "-")}
            {_reconciled("NEW", "+")}
        END""",
    # BEFORE: the job's events are still there to be counted out (the foreign key deletes them with it).
    "job_counts_delete": f"""
        CREATE TRIGGER job_counts_delete BEFORE DELETE ON jobs BEGIN
            {_add("status", "OLD.status", "-1")}
            {_finished("OLD", "-")}
            {_reconciled("OLD", "-")}
        END""",
    # The event follows the UPDATE that set the failure class, in the same transaction.
    "job_counts_reconcile": f"""
        CREATE TRIGGER job_counts_reconcile AFTER INSERT ON job_events
        WHEN NEW.to_status = 'failed' AND NEW.actor != 'supervisor' BEGIN
            INSERT INTO job_counts (metric, label, n)
                SELECT 'reconcile', NEW.actor || '|' || j.failure_class, 1 FROM jobs j
                WHERE j.id = NEW.job_id AND j.failure_class IN {RECONCILED}
                ON CONFLICT (metric, label) DO UPDATE SET n = n + excluded.n;
        END""",
}


def _backfill() -> list[str]:
    j = "j"
    done = f"{j}.status IN {TERMINAL} AND {j}.finished_at IS NOT NULL"
    return [
        "INSERT INTO job_counts (metric, label, n) SELECT 'status', status, count(*) FROM jobs GROUP BY status",
        "INSERT INTO job_counts (metric, label, n) SELECT 'failure', coalesce(failure_class, 'None'), count(*) "
        "FROM jobs WHERE status = 'failed' GROUP BY 2",
        f"INSERT INTO job_counts (metric, label, n) SELECT 'duration_bucket', {j}.status || '|' || {_bucket(j)}, "
        f"count(*) FROM jobs {j} WHERE {done} GROUP BY 2",
        f"INSERT INTO job_counts (metric, label, n) SELECT 'duration_sum', {j}.status, sum({_seconds(j)}) "
        f"FROM jobs {j} WHERE {done} GROUP BY 2",
        "INSERT INTO job_counts (metric, label, n) SELECT 'reconcile', e.actor || '|' || j.failure_class, count(*) "
        "FROM job_events e JOIN jobs j ON j.id = e.job_id WHERE e.to_status = 'failed' AND e.actor != 'supervisor' "
        f"AND j.failure_class IN {RECONCILED} GROUP BY 2",
    ]


def upgrade() -> None:
    op.create_table(
        "job_counts",
        sa.Column("metric", sa.String(32), nullable=False),
        sa.Column("label", sa.String(96), nullable=False),
        sa.Column("n", sa.Float(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("metric", "label"),
    )
    for statement in _backfill():
        op.execute(statement)
    for sql in TRIGGERS.values():
        op.execute(sql)


def downgrade() -> None:
    for name in TRIGGERS:
        op.execute(f"DROP TRIGGER IF EXISTS {name}")
    op.drop_table("job_counts")

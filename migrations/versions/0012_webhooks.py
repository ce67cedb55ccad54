"""Webhooks (issue 27): the outbox of events each job leaves for arbo, each attempt to deliver one, and the
job's subscription.

- `jobs.webhook_events`: which events the job sends (JSON, written once at dispatch; NULL: none). A plain
  ADD COLUMN: `jobs` is not rebuilt, so 0008's triggers and AUTOINCREMENT stay as they are.
- `webhook_events`: one row per event, written in the transaction of the change it tells of. `id` orders a
  job's events (AUTOINCREMENT, never reused); `event_id` is the stable `webhook-id` a receiver deduplicates on.
- `webhook_attempts`: one row per attempt, opened before the request leaves and closed with its answer.
- Triggers keep `job_counts` (metric `webhook`, label pending | retrying | delivered | given_up), so /metrics
  reads a few rows however long the outbox grows; pruning a job deletes its events (ON DELETE CASCADE), and
  the delete trigger takes them off the counts.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

LABEL = "CASE WHEN {r}.state = 'pending' AND {r}.attempts > 0 THEN 'retrying' ELSE {r}.state END"


def _count(row: str, sign: str) -> str:
    return ("INSERT INTO job_counts (metric, label, n) VALUES ('webhook', " + LABEL.format(r=row) + f", {sign}1) "
            "ON CONFLICT (metric, label) DO UPDATE SET n = n + excluded.n;")


TRIGGERS = {
    "webhook_counts_insert": f"""
        CREATE TRIGGER webhook_counts_insert AFTER INSERT ON webhook_events BEGIN
            {_count("NEW", "+")}
        END""",
    "webhook_counts_update": f"""
        CREATE TRIGGER webhook_counts_update AFTER UPDATE OF state, attempts ON webhook_events BEGIN
            {_count("OLD", "-")}
            {_count("NEW", "+")}
        END""",
    "webhook_counts_delete": f"""
        CREATE TRIGGER webhook_counts_delete BEFORE DELETE ON webhook_events BEGIN
            {_count("OLD", "-")}
        END""",
}


def upgrade() -> None:
    op.add_column("jobs", sa.Column("webhook_events", sa.Text(), nullable=True))
    op.create_table(
        "webhook_events",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("event_id", sa.String(40), nullable=False),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("created_at", sa.String(24), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.String(24), nullable=False),
        sa.Column("give_up_at", sa.String(24), nullable=False),
        sa.Column("delivered_at", sa.String(24), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.CheckConstraint("state IN ('pending', 'delivered', 'given_up')", name="webhook_state_valid"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_webhook_events_event_id", "webhook_events", ["event_id"], unique=True)
    op.create_index("ix_webhook_events_job", "webhook_events", ["job_id", "state", "id"])
    op.create_index("ix_webhook_events_due", "webhook_events", ["state", "next_attempt_at"])
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("event_pk", sa.Integer(), sa.ForeignKey("webhook_events.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("started_at", sa.String(24), nullable=False),
        sa.Column("finished_at", sa.String(24), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_webhook_attempts_event_pk", "webhook_attempts", ["event_pk"])
    for sql in TRIGGERS.values():
        op.execute(sql)


def downgrade() -> None:
    for name in TRIGGERS:
        op.execute(f"DROP TRIGGER IF EXISTS {name}")
    op.execute("DELETE FROM job_counts WHERE metric = 'webhook'")
    op.drop_table("webhook_attempts")
    op.drop_table("webhook_events")
    # SQLite 3.35+ drops a column in place; batch mode would rebuild `jobs` and lose 0008's triggers.
    op.execute("ALTER TABLE jobs DROP COLUMN webhook_events")

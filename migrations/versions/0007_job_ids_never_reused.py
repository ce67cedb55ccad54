"""Job ids are never reused: `jobs.id` becomes AUTOINCREMENT.

Without it SQLite hands out max(id) + 1, so after `jobs prune` (or a deleted newest row) the next job takes an
id arbo already knows another job by (it keys its history by worker_job_id). With AUTOINCREMENT the highest id
ever given stays in sqlite_sequence, rows or not. SQLite cannot alter that on a table, so the table is rebuilt
(batch mode, copy and rename); the rows keep their ids, and sqlite_sequence starts at the highest of them.
`lora-worker migrate` then raises it to the highest id in the run-log directory (a ledger recreated empty).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""
from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", recreate="always", table_kwargs={"sqlite_autoincrement": True}):
        pass
    # The copy set sqlite_sequence to the highest id copied; an empty table has no row there yet.
    op.execute("INSERT INTO sqlite_sequence (name, seq) SELECT 'jobs', coalesce((SELECT max(id) FROM jobs), 0) "
               "WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'jobs')")


def downgrade() -> None:
    with op.batch_alter_table("jobs", recreate="always", table_kwargs={"sqlite_autoincrement": False}):
        pass

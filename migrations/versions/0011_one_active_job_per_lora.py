"""At most one active job per LoRA file (issue 22): a partial unique index on `jobs.lora_file` over the active
rows, as `one_active_job` is on `slot`. With several Slurm slots, two requests naming the same output dir and
name were both accepted, and the second save overwrote the first job's verified LoRA.

An index is added and dropped without rebuilding `jobs`, so 0008's triggers and 0007's AUTOINCREMENT (and
sqlite_sequence with it) are untouched. Should two active rows already share a LoRA file, the upgrade stops
on the UNIQUE error naming it: which of them may write the file is not this migration's to guess.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""
from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Written out (not imported from the model), so this revision stays what it was.
ACTIVE_WHERE = "status IN ('queued', 'running')"


def upgrade() -> None:
    op.execute(f"CREATE UNIQUE INDEX one_active_job_per_lora ON jobs (lora_file) WHERE {ACTIVE_WHERE}")


def downgrade() -> None:
    op.execute("DROP INDEX one_active_job_per_lora")

"""Step checkpoints (issue 26): one row per step LoRA and per state a job's trainer announced.

- `checkpoints`: `kind` is 'lora' (a step LoRA `<name>-step%08d.safetensors`) or 'state' (a state directory,
  `<name>-step%08d-state/`, or the end state `<name>-state/`); `step` is the step the trainer named it by; `at`
  when its save line was seen. A step LoRA is verified once the trainer moved on (`bytes`, `sha256`,
  `verified`, `error`); a state is recorded as seen (`verified` NULL: its check is the resume's). `removed_at`:
  the trainer pruned it (`removing old …`), which is not a failed verification. One row per (job, kind, path):
  a poller that re-reads the log writes the same rows again.
- A new table only: `jobs` is not rebuilt, so 0008's triggers and AUTOINCREMENT stay as they are. Pruning a
  job deletes its rows (ON DELETE CASCADE).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("at", sa.String(24), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("verified", sa.Boolean(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("removed_at", sa.String(24), nullable=True),
        sa.CheckConstraint("kind IN ('lora', 'state')", name="checkpoint_kind_valid"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_checkpoints_job_kind_path", "checkpoints", ["job_id", "kind", "path"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_checkpoints_job_kind_path", table_name="checkpoints")
    op.drop_table("checkpoints")

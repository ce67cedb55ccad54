"""Idempotency keys, verified-artifact hash, reproducibility fingerprint, duration estimate.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

COLUMNS = (
    sa.Column("idempotency_key", sa.String(length=128), nullable=True),
    sa.Column("request_sha256", sa.String(length=64), nullable=True),
    sa.Column("lora_sha256", sa.String(length=64), nullable=True),
    sa.Column("lora_size", sa.Integer(), nullable=True),
    sa.Column("sd_scripts_commit", sa.String(length=64), nullable=True),
    sa.Column("trainer_versions", sa.JSON(), nullable=True),
    sa.Column("dataset_sha256", sa.String(length=64), nullable=True),
    sa.Column("base_model_sha256", sa.String(length=64), nullable=True),
    sa.Column("estimated_duration_s", sa.Float(), nullable=True),
    sa.Column("training_started_at", sa.String(length=24), nullable=True),
    sa.Column("eta_basis", sa.String(length=16), nullable=True),
)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for column in COLUMNS:
            batch.add_column(column)
    op.create_index("ix_jobs_idempotency_key", "jobs", ["idempotency_key"], unique=True,
                    sqlite_where=sa.text("idempotency_key IS NOT NULL"))
    op.create_index("ix_jobs_history", "jobs", ["tier", "device_index", "image_count", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_history", table_name="jobs")
    op.drop_index("ix_jobs_idempotency_key", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        for column in reversed(COLUMNS):
            batch.drop_column(column.name)

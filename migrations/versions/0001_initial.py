"""Initial schema: jobs, job_events, job_progress.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Written out in full (no imports from the package) so the migration stays what it was when later code changes.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

STATUSES = "'queued', 'running', 'succeeded', 'failed', 'cancelled'"
PHASES = ("'launching', 'loading_model', 'caching_latents', 'caching_text_encoder_outputs', "
          "'preparing_training', 'training', 'saving'")
FAILURES = ("'cuda_oom', 'dataset_invalid', 'model_load_error', 'tokenizer_missing', 'invalid_arguments', "
            "'killed_by_signal', 'trainer_crashed', 'no_output', 'artifact_invalid', 'artifact_mismatch', "
            "'stalled', 'supervisor_lost', 'host_rebooted', 'launch_error'")


def _ts(name: str, nullable: bool = True) -> sa.Column:
    # ISO-8601 UTC text, e.g. 2026-11-30T04:57:12.123Z
    return sa.Column(name, sa.String(length=24), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("slot", sa.String(length=16), server_default="train", nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("phase", sa.String(length=32), nullable=True),
        sa.Column("train_id", sa.String(length=128), nullable=False),
        sa.Column("dataset_dir", sa.Text(), nullable=False),
        sa.Column("base_model_path", sa.Text(), nullable=False),
        sa.Column("output_dir", sa.Text(), nullable=False),
        sa.Column("output_name", sa.String(length=128), nullable=False),
        sa.Column("trigger", sa.String(length=64), nullable=False),
        sa.Column("subject_class", sa.String(length=64), nullable=False),
        sa.Column("repeats", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("device_index", sa.Integer(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("max_grad_norm", sa.Float(), nullable=True),
        sa.Column("lora_target_modules", sa.String(length=32), nullable=True),
        sa.Column("image_count", sa.Integer(), nullable=False),
        sa.Column("argv", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("step", sa.Integer(), server_default="0", nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("rate", sa.Float(), nullable=True),
        sa.Column("eta_s", sa.Float(), nullable=True),
        _ts("last_progress_at"),
        sa.Column("lora_path", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("failure_class", sa.String(length=32), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("signal", sa.Integer(), nullable=True),
        _ts("created_at", nullable=False),
        _ts("started_at"),
        _ts("finished_at"),
        _ts("updated_at", nullable=False),
        _ts("cancel_requested_at"),
        sa.Column("boot_id", sa.String(length=36), nullable=True),
        sa.Column("supervisor_pid", sa.Integer(), nullable=True),
        sa.Column("supervisor_start_ticks", sa.Integer(), nullable=True),
        sa.Column("trainer_pid", sa.Integer(), nullable=True),
        sa.Column("trainer_start_ticks", sa.Integer(), nullable=True),
        sa.Column("version", sa.Integer(), server_default="1", nullable=False),
        sa.CheckConstraint(f"status IN ({STATUSES})", name="status_valid"),
        sa.CheckConstraint(f"phase IS NULL OR phase IN ({PHASES})", name="phase_valid"),
        sa.CheckConstraint(f"failure_class IS NULL OR failure_class IN ({FAILURES})", name="failure_class_valid"),
        sa.PrimaryKeyConstraint("id"),
    )
    # One active job: a partial UNIQUE index on a real column. (An index on an expression such as ((1))
    # would be dropped silently by the next batch migration: SQLAlchemy cannot reflect it.)
    op.create_index("one_active_job", "jobs", ["slot"], unique=True,
                    sqlite_where=sa.text("status IN ('queued', 'running')"))
    op.create_index("ix_jobs_status_id", "jobs", ["status", "id"])

    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        _ts("at", nullable=False),
        sa.Column("from_status", sa.String(length=16), nullable=True),
        sa.Column("to_status", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])

    op.create_table(
        "job_progress",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        _ts("at", nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "step"),
    )


def downgrade() -> None:
    op.drop_table("job_progress")
    op.drop_index("ix_job_events_job_id", table_name="job_events")
    op.drop_table("job_events")
    op.drop_index("ix_jobs_status_id", table_name="jobs")
    op.drop_index("one_active_job", table_name="jobs")
    op.drop_table("jobs")

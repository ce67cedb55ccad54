"""Sample images and a promoted step (issue 33).

- `jobs.phase` may be `sampling` (a sample pass of the trainer): the phases are a CHECK constraint, so `jobs` is
  rebuilt in batch mode the way 0010 does it (0008's triggers read before and created again word for word after,
  AUTOINCREMENT kept, the highest id ever given put back into sqlite_sequence). The lists are written out here.
- `jobs.sample_prompts`: the job's prompts as JSON, each `{prompt, seed}` (`[]`: the job draws none; NULL: a job
  accepted before samples, which drew none).
- `jobs.promoted_step`: the step whose verified step LoRA `POST /train/<id>/promote` made the job's result
  (`lora_path`, `lora_sha256` are then that file's); NULL: the final LoRA is the result.
- `samples`: one row per image the job's follower found in `<output_dir>/sample/` and decoded: its name, step,
  prompt index, seed, size, bytes and sha256. One row per (job, name); pruning a job deletes its rows.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

BEFORE = ("'launching', 'loading_model', 'caching_latents', 'caching_text_encoder_outputs', 'preparing_training', "
          "'training', 'saving'")
AFTER = ("'launching', 'loading_model', 'caching_latents', 'caching_text_encoder_outputs', 'preparing_training', "
         "'training', 'sampling', 'saving'")


def _rebuild(phases: str, columns: bool) -> None:
    bind = op.get_bind()
    triggers = [row[0] for row in bind.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'jobs' ORDER BY name").fetchall()]
    seq = bind.exec_driver_sql("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").scalar()
    with op.batch_alter_table("jobs", recreate="always", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_constraint("phase_valid", type_="check")
        batch.create_check_constraint("phase_valid", f"phase IS NULL OR phase IN ({phases})")
        if columns:
            batch.add_column(sa.Column("sample_prompts", sa.JSON(), nullable=True))
            batch.add_column(sa.Column("promoted_step", sa.Integer(), nullable=True))
        else:
            batch.drop_column("promoted_step")
            batch.drop_column("sample_prompts")
    for sql in triggers:
        op.execute(sql)
    if seq is not None:
        bind.exec_driver_sql("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'jobs'", (seq,))
        bind.exec_driver_sql("INSERT INTO sqlite_sequence (name, seq) SELECT 'jobs', ? "
                             "WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'jobs')", (seq,))


def upgrade() -> None:
    _rebuild(AFTER, columns=True)
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("prompt_index", sa.Integer(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=True),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("at", sa.String(24), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_samples_job_name", "samples", ["job_id", "name"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_samples_job_name", table_name="samples")
    op.drop_table("samples")
    # A job that ended in a sample pass ended in its training, as the phases before this revision say.
    op.execute("UPDATE jobs SET phase = 'training' WHERE phase = 'sampling'")
    _rebuild(BEFORE, columns=False)

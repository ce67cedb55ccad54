"""The LoRA a job must produce, recorded at dispatch: lora_file, lora_rank, lora_steps, lora_dtype (NOT NULL).

Older rows are backfilled from what they were run with: the rank and steps from the `--network_dim=` and
`--max_train_steps=` tokens of their stored argv, or, for a row without them, from the tier as it was defined
when this revision was written; the dtype is F32, since no earlier job passed --save_precision and sd-scripts
then saves in float32; the file is <output_dir>/<output_name>.safetensors, where the trainer was told to save.

Adding NOT NULL columns needs a table rebuild in SQLite (batch mode: copy, drop, rename; the operator views
survive it through the legacy rename that migrations/env.py turns on).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COLUMNS = (
    sa.Column("lora_file", sa.Text(), nullable=True),
    sa.Column("lora_rank", sa.Integer(), nullable=True),
    sa.Column("lora_steps", sa.Integer(), nullable=True),
    sa.Column("lora_dtype", sa.String(length=8), nullable=True),
)

# The tiers as of this revision (written out, so later changes to the code's TIERS do not rewrite history).
RANK_OF_TIER = "CASE tier WHEN 'fast' THEN 16 WHEN 'balanced' THEN 32 WHEN 'quality' THEN 32 END"
STEPS_OF_TIER = "CASE tier WHEN 'fast' THEN 400 WHEN 'balanced' THEN 1500 WHEN 'quality' THEN 3000 END"


def _argv_value(key: str) -> str:
    """The integer value of the row's `--<key>=` argv token, or NULL."""
    prefix = f"--{key}="
    return (f"(SELECT CAST(substr(value, {len(prefix) + 1}) AS INTEGER) FROM json_each(jobs.argv) "
            f"WHERE substr(value, 1, {len(prefix)}) = '{prefix}' LIMIT 1)")


BACKFILL = f"""
    UPDATE jobs SET
        lora_file = output_dir || '/' || output_name || '.safetensors',
        lora_rank = coalesce({_argv_value("network_dim")}, {RANK_OF_TIER}, 0),
        lora_steps = coalesce({_argv_value("max_train_steps")}, {STEPS_OF_TIER}, total_steps),
        lora_dtype = 'F32'
"""


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for column in COLUMNS:
            batch.add_column(column)
    op.execute(BACKFILL)
    with op.batch_alter_table("jobs", recreate="always") as batch:
        for column in COLUMNS:
            batch.alter_column(column.name, existing_type=column.type, nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for column in reversed(COLUMNS):
            batch.drop_column(column.name)

"""The dataset lint (issue 34): the warnings dispatch found in a job's dataset, kept with the job.

- `jobs.dataset_warnings`: a JSON list of `{code, severity, file, message}` (lora_worker/findings.py), what the
  202 said under `warnings`; `GET /train/<id>` and `lora-worker jobs show` show it again. NULL for a job accepted
  before the lint, or one without a dataset of its own (a resume carries its original's).

A plain ADD COLUMN: `jobs` is not rebuilt, so 0008's triggers and 0007's AUTOINCREMENT stay as they are.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("dataset_warnings", sa.Text(), nullable=True))


def downgrade() -> None:
    # SQLite 3.35+ drops a column in place; batch mode would rebuild `jobs` and lose 0008's triggers.
    op.execute("ALTER TABLE jobs DROP COLUMN dataset_warnings")

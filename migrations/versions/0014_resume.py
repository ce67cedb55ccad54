"""Resume (issue 26): a job started from another's saved state records which job it continues and how.

- `jobs.resumed_from`: the id of the job whose state this one continues (NULL: a job of its own request).
  No foreign key: a pruned original must not take its resumes with it, and ADD COLUMN cannot add one anyway.
- `jobs.attempt`: 1 for a job of its own request, the original's attempt + 1 for a resume; reconcile's
  automatic resume reads it so that a resume's failures never loop.
- `jobs.resume_step`: the step of the state the resume starts from (0 for a fresh job): the step counts on
  from it, and the ETA knows how many steps are left.
- `jobs.base_model_identity`: the base model's `dev:ino:size:mtime_ns:ctime_ns` at dispatch: a resume trains on
  the very file the run did, unchanged (NULL for a job accepted before: its resume is refused).

Plain ADD COLUMNs: `jobs` is not rebuilt, so 0008's triggers and 0007's AUTOINCREMENT stay as they are.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("resumed_from", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("attempt", sa.Integer(), nullable=False, server_default="1"))
    op.add_column("jobs", sa.Column("resume_step", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("base_model_identity", sa.String(96), nullable=True))
    op.create_index("ix_jobs_resumed_from", "jobs", ["resumed_from"])


def downgrade() -> None:
    op.drop_index("ix_jobs_resumed_from", "jobs")
    # SQLite 3.35+ drops a column in place; batch mode would rebuild `jobs` and lose 0008's triggers.
    for column in ("base_model_identity", "resume_step", "attempt", "resumed_from"):
        op.execute(f"ALTER TABLE jobs DROP COLUMN {column}")

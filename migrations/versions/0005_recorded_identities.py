"""The (device, inode) of the directories dispatch checked: dataset dir, kohya folder, output dir.

The supervisor compares them right before exec and refuses to start the trainer if any was replaced.
Rows from before this revision have none, and are checked without them.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

COLUMNS = ("dataset_dev_ino", "kohya_dev_ino", "output_dev_ino")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.String(length=48), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)

"""failure_class may be 'tokenizer_invalid': tokenizer files present but broken (issue 15).

The allowed values are a CHECK constraint, so the table is rebuilt (batch mode) with the new list. The lists
are written out here rather than taken from FailureClass, so this revision stays what it was.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""
from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

BEFORE = ("'cuda_oom', 'dataset_invalid', 'model_load_error', 'tokenizer_missing', 'invalid_arguments', "
          "'killed_by_signal', 'trainer_crashed', 'no_output', 'artifact_invalid', 'artifact_mismatch', "
          "'stalled', 'supervisor_lost', 'host_rebooted', 'launch_error'")
AFTER = ("'cuda_oom', 'dataset_invalid', 'model_load_error', 'tokenizer_missing', 'tokenizer_invalid', "
         "'invalid_arguments', 'killed_by_signal', 'trainer_crashed', 'no_output', 'artifact_invalid', "
         "'artifact_mismatch', 'stalled', 'supervisor_lost', 'host_rebooted', 'launch_error'")


def _replace_check(values: str) -> None:
    with op.batch_alter_table("jobs", recreate="always") as batch:
        batch.drop_constraint("failure_class_valid", type_="check")
        batch.create_check_constraint("failure_class_valid", f"failure_class IS NULL OR failure_class IN ({values})")


def upgrade() -> None:
    _replace_check(AFTER)


def downgrade() -> None:
    # A row that failed with the new class could not be kept under the old CHECK; it becomes trainer_crashed.
    op.execute("UPDATE jobs SET failure_class = 'trainer_crashed' WHERE failure_class = 'tokenizer_invalid'")
    _replace_check(BEFORE)

"""Two failure classes of the supervisor's own: `nan_loss` (the loss became NaN and the run was stopped) and
`supervisor_signalled` (the supervisor got a signal that was no client's cancel: a shutdown, `systemctl kill`).

The failure classes are a CHECK constraint, so `jobs` is rebuilt in batch mode, the way 0009 does it: 0008's
triggers read from sqlite_master before and created again word for word after, AUTOINCREMENT kept, and the
highest id ever given put back into sqlite_sequence. The lists are written out here, so this revision stays
what it was.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""
from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

BEFORE = ("'cuda_oom', 'dataset_invalid', 'model_load_error', 'tokenizer_missing', 'tokenizer_invalid', "
          "'invalid_arguments', 'killed_by_signal', 'trainer_crashed', 'no_output', 'artifact_invalid', "
          "'artifact_mismatch', 'stalled', 'supervisor_lost', 'host_rebooted', 'launch_error', "
          "'out_of_memory', 'time_limit', 'node_fail', 'slurm_lost'")
ADDED = "'nan_loss', 'supervisor_signalled'"
AFTER = f"{BEFORE}, {ADDED}"


def _rebuild(values: str) -> None:
    bind = op.get_bind()
    triggers = [row[0] for row in bind.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'jobs' ORDER BY name").fetchall()]
    seq = bind.exec_driver_sql("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").scalar()
    with op.batch_alter_table("jobs", recreate="always", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_constraint("failure_class_valid", type_="check")
        batch.create_check_constraint("failure_class_valid", f"failure_class IS NULL OR failure_class IN ({values})")
    for sql in triggers:
        op.execute(sql)
    if seq is not None:
        bind.exec_driver_sql("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'jobs'", (seq,))
        bind.exec_driver_sql("INSERT INTO sqlite_sequence (name, seq) SELECT 'jobs', ? "
                             "WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'jobs')", (seq,))


def upgrade() -> None:
    _rebuild(AFTER)


def downgrade() -> None:
    # What the old classes would have made of them, keeping arbo's reading: a supervisor's signal stopped the
    # run (a kill, which a new try may pass), and a NaN loss needs a fix first (a failed run, as a crash). Neither
    # is a reconcile class (supervisor_lost, host_rebooted), so /metrics' reconcile counts stay what they were;
    # the row's `error` still says what happened.
    op.execute("UPDATE jobs SET failure_class = 'killed_by_signal' WHERE failure_class = 'supervisor_signalled'")
    op.execute("UPDATE jobs SET failure_class = 'trainer_crashed' WHERE failure_class = 'nan_loss'")
    _rebuild(BEFORE)

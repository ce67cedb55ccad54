"""Jobs on Slurm (issue 17): `backend`, `slurm_job_id` and `queue_reason` columns, and the failure classes
Slurm's own endings need (out_of_memory, time_limit, node_fail, slurm_lost).

The failure classes are a CHECK constraint, so `jobs` is rebuilt (batch mode, as 0006 does). Two earlier
revisions constrain that rebuild: 0007 made `jobs.id` AUTOINCREMENT (the copy must keep it, and
sqlite_sequence with it), and 0008 put triggers on `jobs`, which SQLite drops with the old table. The triggers
are read from sqlite_master before the rebuild and created again, word for word, after it: this revision
changes no count. sqlite_sequence loses the old table's row with it, and the copy sets it to the highest id
copied: the highest id ever given (a pruned newest job's) is read first and put back, so no id is reused. The
lists are written out here, so this revision stays what it was.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

BEFORE = ("'cuda_oom', 'dataset_invalid', 'model_load_error', 'tokenizer_missing', 'tokenizer_invalid', "
          "'invalid_arguments', 'killed_by_signal', 'trainer_crashed', 'no_output', 'artifact_invalid', "
          "'artifact_mismatch', 'stalled', 'supervisor_lost', 'host_rebooted', 'launch_error'")
ADDED = "'out_of_memory', 'time_limit', 'node_fail', 'slurm_lost'"
AFTER = f"{BEFORE}, {ADDED}"


def _jobs_triggers() -> list[str]:
    rows = op.get_bind().exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'jobs' ORDER BY name").fetchall()
    return [row[0] for row in rows]


def _rebuild(values: str, add: bool) -> None:
    triggers = _jobs_triggers()
    bind = op.get_bind()
    seq = bind.exec_driver_sql("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").scalar()
    with op.batch_alter_table("jobs", recreate="always", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_constraint("failure_class_valid", type_="check")
        batch.create_check_constraint("failure_class_valid", f"failure_class IS NULL OR failure_class IN ({values})")
        if add:
            batch.add_column(sa.Column("backend", sa.String(8), nullable=False, server_default="local"))
            batch.add_column(sa.Column("slurm_job_id", sa.String(32), nullable=True))
            batch.add_column(sa.Column("queue_reason", sa.String(64), nullable=True))
        else:
            batch.drop_column("queue_reason")
            batch.drop_column("slurm_job_id")
            batch.drop_column("backend")
    for sql in triggers:
        op.execute(sql)
    if seq is not None:
        bind.exec_driver_sql("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'jobs'", (seq,))
        bind.exec_driver_sql("INSERT INTO sqlite_sequence (name, seq) SELECT 'jobs', ? "
                             "WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'jobs')", (seq,))


def upgrade() -> None:
    _rebuild(AFTER, add=True)


def downgrade() -> None:
    # A row that failed with a new class could not be kept under the old CHECK: Slurm's endings read as what
    # the old classes would have made of them: a kill, which a new try may pass. A job Slurm lost is one too,
    # not `supervisor_lost`: 0008's triggers count a supervisor_lost row failed by anyone but the supervisor (here
    # the actor "slurm") as a reconcile action, and /metrics would show reconciles that never happened.
    op.execute("UPDATE jobs SET failure_class = 'killed_by_signal' "
               "WHERE failure_class IN ('out_of_memory', 'time_limit', 'node_fail', 'slurm_lost')")
    _rebuild(BEFORE, add=False)

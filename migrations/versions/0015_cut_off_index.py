"""An index for the jobs a reboot cut off: `jobs (status, failure_class, id)`.

Every reconcile of the web process (at start-up, every 30 s, before an authenticated request at most every 5 s,
and on each /metrics scrape) asks for the failed `host_rebooted` jobs no resume has looked at
(`ledger/resumes.cut_off_unlooked`, issue 26). Through `ix_jobs_status_id` that read every failed row to test its
failure class: 23 ms a call at 100,000 jobs (20,000 failed), which made start-up, /metrics and the job list grow
with the history again (`python -m bench.history`, 2026-12-05). With this index the query reads only the rows it
returns. About 23 bytes a job.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05
"""
from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_status_failure_class", "jobs", ["status", "failure_class", "id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_status_failure_class", "jobs")

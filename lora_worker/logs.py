"""Logging to stderr, one line per event with the job id, for journald. Never logs the API token."""
from __future__ import annotations

import logging
import sys


class _JobField(logging.Filter):
    def __init__(self, job_id: int | None) -> None:
        super().__init__()
        self.job_id = "-" if job_id is None else str(job_id)

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "job"):
            record.job = self.job_id
        return True


def configure_logging(*, job_id: int | None = None, level: int = logging.INFO) -> None:
    """`<level> <logger> job=<id>: <message>`; journald adds the time and the unit."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s job=%(job)s: %(message)s"))
    handler.addFilter(_JobField(job_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # one line per plugin, every run

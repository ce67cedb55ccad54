"""`lora-worker jobs` run in-process, and the ledger rows and logs its tests read."""
from __future__ import annotations

import io
from datetime import timedelta

from lora_worker.ledger import repository as repo
from lora_worker.ledger.models import utcnow
from lora_worker.ops.cli import build_parser
from lora_worker.ops.jobs import run
from lora_worker.states import JobState
from lora_worker.transcript.logfile import JobLog
from tests.helpers.ledger import columns

def jobs(settings, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = run(settings, build_parser().parse_args(["jobs", *argv]), out)
    return code, out.getvalue()


def finished(db, state: JobState, days_ago: float, lora_path: str | None = None, **values: object) -> int:
    job = repo.create_job(db, columns(**values))
    end = utcnow() - timedelta(days=days_ago)
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", started_at=end - timedelta(minutes=10))
    repo.update_running(db, job.id, step=3, points=[(1, 0.5, end), (2, 0.4, end)])
    extra = ({"failure_class": "cuda_oom", "error": "CUDA ran out of memory.\ntorch.OutOfMemoryError"}
             if state is JobState.FAILED else {"lora_path": lora_path or f"/out/{job.id}.safetensors"})
    repo.transition(db, job.id, state, actor="supervisor", finished_at=end, **extra)
    return job.id


def write_log(settings, job_id: int, lines: list[str]) -> JobLog:
    joblog = JobLog(settings.log_dir, job_id, head_bytes=200, tail_bytes=10_000)  # small head: a tail file too
    for line in lines:
        joblog.feed(line + "\n")
    return joblog


"""The run log of a job, opened by the supervisor before the job is `running`: a log that cannot be created (a full
disk, no inodes left, its directory taken by a file) fails the job from `queued` with the reason, instead of
leaving a `running` row that nothing supervises until someone reads it. (What a failed run leaves at the LoRA's
path is set aside by the follower, for every backend: transcript/partial.py.)
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from lora_worker.config import Settings
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.states import FailureClass
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.persist import persist

log = logging.getLogger(__name__)


def open_run_log(job_id: int, settings: Settings, db: SupervisorLedger,
                 sleep: Callable[[float], None]) -> JobLog | None:
    """The job's new run log, or None once the job is failed (`launch_error`) because it cannot be created."""
    try:
        return JobLog(settings.log_dir, job_id, head_bytes=settings.log_head_bytes, tail_bytes=settings.log_tail_bytes)
    except OSError as exc:
        sentence = (f"Cannot create the run log of job {job_id} in {settings.log_dir} "
                    f"({exc.strerror or exc}); the trainer was not started")
        log.error("job %s: %s", job_id, sentence)
        persist(lambda: db.fail_job(job_id, failure_class=FailureClass.LAUNCH_ERROR, sentence=sentence),
                f"job {job_id}: record that the run log cannot be created", sleep)
        return None

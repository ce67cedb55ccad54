"""The files of a job the supervisor makes or moves itself, around the run:

- the run log, opened before the job is `running`: a log that cannot be created (a full disk, no inodes left, its
  directory taken by a file) fails the job from `queued` with the reason, instead of leaving a `running` row
  that nothing supervises until someone reads it;
- what a failed or cancelled run of ours leaves at the LoRA's path: a partial file (a save cut by ENOSPC, a kill
  or a cancel during `saving`), a whole one that did not verify, or one the trainer finished as the cancel stopped
  it (that job ends `cancelled`: states.CANCEL_RULE). It is no finished LoRA, and left there it would make every
  retry of the same request a 422 `output_exists`. So it is moved aside, in the same
  directory, to `<name>.partial-<job_id>` (never deleted: the operator may want it; `jobs prune` removes it
  with the job), and the move is said in the run log and in the job's events. Only after a trainer of this job
  ran: the pre-exec check (run/prelaunch.py) found nothing at the path then, so what is there now is the
  trainer's. The output directory is opened without following a link and held to the identity dispatch
  recorded; the rename is of the entry itself (renameat on that descriptor), never followed.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from lora_worker.config import Settings
from lora_worker.host import fs
from lora_worker.ledger.supervisor import JobRecord, SupervisorLedger
from lora_worker.states import FailureClass, JobState
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.outcome import Outcome
from lora_worker.transcript.output import TrainerOutput
from lora_worker.transcript.persist import persist

log = logging.getLogger(__name__)
PARTIAL = ".partial-"


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


def partial_name(lora_name: str, job_id: int) -> str:
    return f"{lora_name}{PARTIAL}{job_id}"


def set_aside(job: JobRecord, outcome: Outcome, trainer_ran: bool, db: SupervisorLedger, output: TrainerOutput,
              sleep: Callable[[float], None]) -> None:
    """Move what lies at the LoRA's path aside, when its trainer ran and the job does not end `succeeded`: it
    failed, was stopped, or was cancelled while the trainer finished (the ledger then writes `cancelled`)."""
    if not trainer_ran or (outcome.state is JobState.SUCCEEDED and not persist(
            lambda: db.cancel_state(job.id)[1], f"job {job.id}: read the cancel flag", sleep)):
        return
    name = os.path.basename(job.lora_file)
    try:
        aside = _rename_aside(job.output_dir, job.output_dev_ino, name, partial_name(name, job.id))
    except OSError as exc:
        output.note(f"the LoRA path {job.lora_file} could not be moved aside ({exc.strerror or exc})")
        return
    if aside is None:
        return
    what = (f"no finished LoRA: {name} moved aside to {aside} in output_dir (never deleted); a retry of the same "
            "request may write it again")
    output.note(what)
    log.info("job %s: %s", job.id, what)
    persist(lambda: db.note(job.id, what), f"job {job.id}: record the partial LoRA moved aside", sleep)


def _rename_aside(output_dir: str, recorded: str | None, name: str, aside: str) -> str | None:
    """Rename `name` to `aside` (or `aside-<ns>` if taken) in output_dir; None when nothing is at `name`."""
    fd = fs.open_dir(output_dir)
    try:
        if recorded is not None and fs.FileId.of(os.fstat(fd)) != fs.FileId.parse(recorded):
            raise OSError(f"{output_dir} is not the directory that was checked")
        if fs.entry_at(fd, name) is None:
            return None
        if fs.entry_at(fd, aside) is not None:
            aside = f"{aside}-{time.time_ns()}"
        os.rename(name, aside, src_dir_fd=fd, dst_dir_fd=fd)
        return aside
    finally:
        os.close(fd)

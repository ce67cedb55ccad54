"""What a run that does not end `succeeded` leaves at the LoRA's path, set aside, on every backend: a partial file
(a save cut by ENOSPC, a kill, a cancel or a time limit during `saving`), or a whole one that did not verify. It is
no finished LoRA, and left there it would make every retry of the same request a 422 `output_exists` (and refuse a
resume, `lora_file_exists`). So it is moved aside, in the same directory, to `<name>.partial-<job_id>` (never
deleted: the operator may want it; `jobs prune` removes it with the job), and the move is said in the run log and
in the job's events (transcript/follower.py notes it).

Only after a trainer of this job ran: the pre-exec check (run/prelaunch.py, on this host or the node) found nothing
at the path then, so what is there now is the trainer's. The output directory (shared storage under Slurm: the
poller's host sees the node's files) is opened without following a link and held to the identity dispatch
recorded; the rename is of the entry itself (renameat on that descriptor), never followed.
"""
from __future__ import annotations

import logging
import os
import time

from lora_worker.host import fs
from lora_worker.transcript.output import TrainerOutput

log = logging.getLogger(__name__)
PARTIAL = ".partial-"


def partial_name(lora_name: str, job_id: int) -> str:
    return f"{lora_name}{PARTIAL}{job_id}"


def set_aside(job_id: int, lora_file: str, output_dir: str, output_dev_ino: str | None,
              output: TrainerOutput) -> str | None:
    """Move what lies at the LoRA's path aside; the sentence for the job's events, or None if nothing moved."""
    name = os.path.basename(lora_file)
    try:
        aside = _rename_aside(output_dir, output_dev_ino, name, partial_name(name, job_id))
    except OSError as exc:
        output.note(f"the LoRA path {lora_file} could not be moved aside ({exc.strerror or exc})")
        return None
    if aside is None:
        return None
    what = (f"no finished LoRA: {name} moved aside to {aside} in output_dir (never deleted); a retry of the same "
            "request may write it again")
    output.note(what)
    log.info("job %s: %s", job_id, what)
    return what


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

"""A job's submission to Slurm: its batch script, the sbatch flags, the files the node writes back, and what is
done when sbatch fails after slurmctld may already have queued the job.

Under `slurm_log_dir` (storage the node and the worker both see) each job has:
- `<id>.sbatch`: the batch script, the same three lines for every job: it runs `python -m lora_worker.run.node`
  with the worker's own interpreter on the job's spec. No value of the job is in it;
- `<id>.job.json`: that spec, the data the node needs (the row's columns the pre-exec look compares, the argv,
  the env, the settings), read by the node without following a link and without blocking;
- `<id>.log`: sbatch's `--output` (`--open-mode=append`), the trainer's stdout and stderr byte for byte, which
  the poller tails with the supervisor's parser. Made empty here first, so slurmd appends to our file; the
  node refuses to run when its stdout is another file;
- `<id>.rc`: the trainer's own exit status, as a Popen return code (negative: killed by that signal), written
  by the node once the trainer has ended;
- `<id>.refused`: why the node would not start the trainer (the pre-exec look found something moved, or the
  sandbox is missing there): the poller ends the row `launch_error` with that sentence.
Every one of them is created O_CREAT|O_EXCL|O_NOFOLLOW by whoever writes it (here, or run/node.py on the node):
a name already taken, by a link or anything else, refuses the launch and is never written through.

Flags: `--parsable --no-requeue --gres=<tier's gres> [--constraint=<tier's>] --partition=P --time=<tier's
minutes> --mem=<tier's MB> --job-name=<unique name> --output=<dir>/<id>.log --open-mode=append --chdir=<dir>`.
`--no-requeue`: a requeued job would be a second run under the same id (the reference saw a lost node requeue
a job whose trainer still ran). The job name (`lora-<id>-<8 hex of the state dir>`) is unique to this worker's
job, so a job sbatch queued without telling us its id (it timed out, or failed after slurmctld took the job)
is found by name: adopted when it is the only one, else scancelled, never left running unfollowed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

from lora_worker.config import Settings, settings_to_json
from lora_worker.errors import LaunchFailed
from lora_worker.host import fs
from lora_worker.ledger.models import Job
from lora_worker.ledger.supervisor import RECORD_COLUMNS
from lora_worker.slurm.scheduler import Scheduler, SchedulerUnavailable
from lora_worker.states import FailureClass, JobState
from lora_worker.transcript.outcome import Outcome

# What Slurm sets for the job that the trainer must see (the GPU it allocated), over the stored env's values.
FROM_SLURM = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")
NODE_MODULE = "lora_worker.run.node"
REFUSAL_MAX_BYTES = 16 * 1024

SCRIPT = """#!/bin/sh
# lora-worker: a Slurm batch job. Its one argument is the job's spec (<id>.job.json); nothing of the job is here.
exec {python} -m {module} "$1"
"""


def log_path(settings: Settings, job_id: int) -> Path:
    return settings.slurm_logs / f"{job_id}.log"


def rc_path(settings: Settings, job_id: int) -> Path:
    return settings.slurm_logs / f"{job_id}.rc"


def script_path(settings: Settings, job_id: int) -> Path:
    return settings.slurm_logs / f"{job_id}.sbatch"


def spec_path(settings: Settings, job_id: int) -> Path:
    return settings.slurm_logs / f"{job_id}.job.json"


def refusal_path(settings: Settings, job_id: int) -> Path:
    return settings.slurm_logs / f"{job_id}.refused"


def job_name(settings: Settings, job_id: int) -> str:
    """Unique on the cluster: the job id is never reused by this ledger, the state dir tells two workers apart."""
    return f"lora-{job_id}-{hashlib.sha256(str(settings.state_dir).encode()).hexdigest()[:8]}"


def batch_script() -> str:
    return SCRIPT.format(python=shlex.quote(sys.executable), module=NODE_MODULE)


def node_spec(job: Job, settings: Settings, log_id: fs.FileId) -> dict[str, object]:
    """What run/node.py needs on the node, as data: the row as the supervisor reads it, and where to write."""
    return {
        "job": {name: getattr(job, name) for name in RECORD_COLUMNS},
        "settings": json.loads(settings_to_json(settings)),
        "cwd": str(settings.sd_scripts_dir),
        "from_environment": list(FROM_SLURM),
        "log_file": str(log_path(settings, job.id)), "log_id": str(log_id),
        "rc_file": str(rc_path(settings, job.id)), "refusal_file": str(refusal_path(settings, job.id)),
    }


def sbatch_options(job: Job, settings: Settings) -> list[str]:
    tier, resources = job.tier, settings.slurm_resources[job.tier]
    options = ["--parsable", "--no-requeue", f"--gres={resources.gres}"]
    if resources.constraint:
        options.append(f"--constraint={resources.constraint}")
    return options + [
        f"--partition={settings.slurm_partition}", f"--time={settings.slurm_time_limit_min[tier]}",
        f"--mem={settings.slurm_mem_mb[tier]}", f"--job-name={job_name(settings, job.id)}",
        f"--output={log_path(settings, job.id)}", "--open-mode=append", f"--chdir={settings.slurm_logs}",
    ]


def write_files(job: Job, settings: Settings) -> Path:
    """The job's log (empty), spec and batch script, each made now by us; the script's path."""
    settings.slurm_logs.mkdir(parents=True, exist_ok=True)
    log_id = fs.create_new(str(log_path(settings, job.id)), b"")
    spec = json.dumps(node_spec(job, settings, log_id), ensure_ascii=False).encode()
    fs.create_new(str(spec_path(settings, job.id)), spec)
    script = script_path(settings, job.id)
    fs.create_new(str(script), batch_script().encode(), 0o750)
    return script


def submit(job: Job, settings: Settings, scheduler: Scheduler) -> str:
    """The Slurm job id of the job's submission; LaunchFailed when none runs.

    When sbatch fails or times out, slurmctld may have queued the job all the same: it is looked up by its
    name. One job found is the submission (adopted: its id is returned); several are scancelled; when the lookup
    cannot be answered, a `scancel --name` is sent anyway before the failure is reported."""
    try:
        script = write_files(job, settings)
    except OSError as exc:
        raise LaunchFailed(f"Cannot write the Slurm files of job {job.id}: {exc}", job_id=job.id) from exc
    name = job_name(settings, job.id)
    try:
        return scheduler.submit(sbatch_options(job, settings), script, [str(spec_path(settings, job.id))])
    except SchedulerUnavailable as exc:
        failure = exc
    try:
        found = scheduler.find_by_name(name)
    except SchedulerUnavailable as exc:
        _cancel_by_name(scheduler, name)
        raise LaunchFailed(f"Slurm refused job {job.id}: {failure}; whether it queued the job is unknown "
                           f"({exc}), so `scancel --name={name}` was sent", job_id=job.id) from failure
    if len(found) == 1:
        return found[0]
    _cancel_by_name(scheduler, name)
    extra = f"; {len(found)} jobs named {name} were scancelled" if found else ""
    raise LaunchFailed(f"Slurm refused job {job.id}: {failure}{extra}", job_id=job.id) from failure


def _cancel_by_name(scheduler: Scheduler, name: str) -> None:
    try:
        scheduler.cancel_by_name(name)
    except SchedulerUnavailable:
        pass  # nothing more can be done now; the name stays unique, so an operator's `scancel --name` finds it


def refused_outcome(settings: Settings, job_id: int, log_tail: list[str]) -> Outcome | None:
    """`failed` (`launch_error`) when the node refused to start the trainer (as the local supervisor's pre-exec
    look does), None when it wrote no refusal."""
    sentence = refusal(settings, job_id)
    if sentence is None:
        return None
    return Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR, f"The node did not start the trainer: {sentence}",
                   log_lines=tuple(log_tail))


def refusal(settings: Settings, job_id: int) -> str | None:
    """The node's sentence for a trainer it would not start (run/node.py), None when it wrote none."""
    try:
        fd, _ = fs.open_regular(None, str(refusal_path(settings, job_id)))
    except OSError:
        return None
    try:
        text = fs.read_capped(fd, REFUSAL_MAX_BYTES).decode("utf-8", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return text or None

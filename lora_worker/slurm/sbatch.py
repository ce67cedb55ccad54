"""A job's submission to Slurm: its batch script, the sbatch flags, and the files the node writes back.

Under `slurm_log_dir` (storage the node and the worker both see) each job has:
- `<id>.sbatch`: the batch script, written here once (O_EXCL: never a second job's, never through a link);
- `<id>.log`: sbatch's `--output`, the trainer's stdout and stderr byte for byte (tqdm's `\\r` redraws kept),
  which the poller tails with the supervisor's parser;
- `<id>.rc`: the trainer's own exit status, as a Popen return code (negative: killed by that signal), written by
  the batch script once the trainer has ended (write, fsync, rename: the poller never reads half of it).

The batch script is Python, not sh: sacct truncates exit codes above 127, and a shell's `$?` cannot tell exit
200 from a signal (both read 128 + n), so the script records the exact wait status itself. It ignores SIGTERM
by a handler that does nothing (the trainer, exec'd afresh, gets the default back; `trap '' TERM` would be
inherited) so that `scancel --signal=TERM --full` stops the trainer, and the script lives to record how. It runs
the stored argv, in `sd_scripts_dir`, with the stored env only, plus the GPU Slurm allocated
(`CUDA_VISIBLE_DEVICES` from the GRES) in place of the one the request named. No sandbox: Slurm's cgroup is
the job's container on the node.

Flags: `--parsable --no-requeue --gres=gpu:1 --partition=P --time=<tier's minutes> --mem=<tier's MB>
--job-name=lora-<id> --output=<dir>/<id>.log --chdir=<dir>`. `--no-requeue`: a requeued job would be a second
run under the same id (the reference saw a lost node requeue a job whose trainer still ran).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.ledger.models import Job

# What Slurm sets for the job that the trainer must see (the GPU it allocated), over the stored env's values.
FROM_SLURM = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")

SCRIPT = '''#!/usr/bin/env python3
# lora-worker: Slurm batch script of job {job_id}, generated at dispatch. It runs the job's stored command once
# and records the trainer's exit status (a Popen return code) in {rc_name}.
import os, signal, subprocess, sys

ARGV = {argv}
CWD = {cwd}
ENV = {env}
RC = {rc}
FROM_SLURM = {from_slurm}

# Outlive the trainer: scancel --signal=TERM --full reaches us too, and we must record how it ended.
signal.signal(signal.SIGTERM, lambda signum, frame: None)
env = dict(ENV)
env.update({{name: os.environ[name] for name in FROM_SLURM if name in os.environ}})
print("[lora-worker] job {job_id}: Slurm job " + os.environ.get("SLURM_JOB_ID", "?") + " on "
      + os.uname().nodename + ", CUDA_VISIBLE_DEVICES=" + env.get("CUDA_VISIBLE_DEVICES", ""), flush=True)
try:
    trainer = subprocess.Popen(ARGV, cwd=CWD, env=env, stdin=subprocess.DEVNULL)
except OSError as exc:
    print("[lora-worker] cannot start the trainer: " + str(exc), flush=True)
    sys.exit(1)  # no .rc: the poller reads Slurm's FAILED and this line
rc = trainer.wait()
tmp = RC + ".tmp"
with open(tmp, "w") as fh:
    fh.write(str(rc) + "\\n")
    fh.flush()
    os.fsync(fh.fileno())
os.rename(tmp, RC)
print("[lora-worker] trainer ended with return code " + str(rc), flush=True)
sys.exit(0 if rc == 0 else 1)
'''


def log_path(settings: Settings, job_id: int) -> Path:
    return settings.slurm_logs / f"{job_id}.log"


def rc_path(settings: Settings, job_id: int) -> Path:
    return settings.slurm_logs / f"{job_id}.rc"


def script_path(settings: Settings, job_id: int) -> Path:
    return settings.slurm_logs / f"{job_id}.sbatch"


def batch_script(job: Job, settings: Settings) -> str:
    rc = rc_path(settings, job.id)
    return SCRIPT.format(job_id=job.id, rc_name=rc.name, argv=json.dumps(list(job.argv)),
                         cwd=json.dumps(str(settings.sd_scripts_dir)), env=json.dumps(dict(job.env)),
                         rc=json.dumps(str(rc)), from_slurm=json.dumps(list(FROM_SLURM)))


def sbatch_options(job: Job, settings: Settings) -> list[str]:
    return [
        "--parsable", "--no-requeue", "--gres=gpu:1", f"--partition={settings.slurm_partition}",
        f"--time={settings.slurm_time_limit_min[job.tier]}", f"--mem={settings.slurm_mem_mb[job.tier]}",
        f"--job-name=lora-{job.id}", f"--output={log_path(settings, job.id)}", f"--chdir={settings.slurm_logs}",
    ]


def write_script(job: Job, settings: Settings) -> Path:
    """The batch script, in a file made now by us: O_EXCL, no link followed."""
    settings.slurm_logs.mkdir(parents=True, exist_ok=True)
    path = script_path(settings, job.id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o750)
    with os.fdopen(fd, "w") as fh:
        fh.write(batch_script(job, settings))
    return path

"""The submission: sbatch's flags and the batch script, which runs the stored argv and records the trainer's
exact status (sacct truncates above 127; a shell cannot tell exit 200 from a signal), surviving a SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lora_worker.slurm.sbatch import log_path, rc_path
from tests.helpers import payload, wait_for
from tests.slurm.fakes import SlurmWorker


def with_argv(script, argv: list[str]) -> None:
    text = script.read_text()
    start = text.index("ARGV = ") + len("ARGV = ")
    script.write_text(text[:start] + repr(argv) + text[text.index("\n", start):])


def test_sbatch_gets_the_fixed_flags_and_the_tiers_limits(slurm: SlurmWorker):
    job = slurm.submit(tier="balanced")
    s = slurm.settings
    options = slurm.scheduler.options[job.slurm_job_id]
    assert options[:5] == ["--parsable", "--no-requeue", "--gres=gpu:1", "--partition=gpu",
                           f"--time={s.slurm_time_limit_min['balanced']}"]
    assert f"--mem={s.slurm_mem_mb['balanced']}" in options and f"--job-name=lora-{job.id}" in options
    assert f"--output={log_path(s, job.id)}" in options
    script = slurm.scheduler.scripts[job.slurm_job_id]
    assert script.read_text().startswith("#!/usr/bin/env python3\n") and os.access(script, os.X_OK)


def test_a_batch_script_is_never_written_over_an_existing_file(slurm: SlurmWorker):
    slurm.settings.slurm_logs.mkdir(parents=True, exist_ok=True)
    planted = slurm.settings.slurm_logs / "1.sbatch"
    planted.symlink_to(slurm.settings.state_dir / "elsewhere")
    answer = slurm.client.post("/train", json=payload(slurm.host.dataset, slurm.host.model))
    assert answer.status_code == 503 and answer.get_json()["error"] == "launch_failed"
    assert not (slurm.settings.state_dir / "elsewhere").exists()
    assert slurm.scheduler.scripts == {}  # nothing was submitted


def run_script(slurm: SlurmWorker, argv: list[str], env: dict | None = None) -> tuple[subprocess.Popen, object]:
    job = slurm.submit()
    script = slurm.scheduler.scripts[job.slurm_job_id]
    with_argv(script, argv)
    out = log_path(slurm.settings, job.id).open("ab")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **(env or {})})
    out.close()
    return proc, job


@pytest.mark.slow
def test_the_script_records_exit_200_exactly(slurm: SlurmWorker):
    proc, job = run_script(slurm, ["/bin/sh", "-c", "exit 200"])
    assert proc.wait(30) == 1
    assert rc_path(slurm.settings, job.id).read_text() == "200\n"


@pytest.mark.slow
def test_the_script_outlives_a_term_to_the_whole_job_and_records_the_trainers_signal(slurm: SlurmWorker):
    """scancel --signal=TERM --full signals every process of the job, the script included."""
    proc, job = run_script(slurm, [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    wait_for(lambda: b"up" in log_path(slurm.settings, job.id).read_bytes(), what="the trainer to start")
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 1
    assert rc_path(slurm.settings, job.id).read_text() == "-15\n"
    assert "trainer ended with return code -15" in log_path(slurm.settings, job.id).read_text()


@pytest.mark.slow
def test_the_trainer_gets_the_stored_env_and_slurms_gpu(slurm: SlurmWorker):
    proc, job = run_script(slurm, [sys.executable, "-c", "import os; print('GPU=' + os.environ['CUDA_VISIBLE_DEVICES'],"
                                   " 'TOKEN=' + os.environ.get('SECRET_OF_THE_WEB', '-'), 'CWD=' + os.getcwd())"],
                           env={"CUDA_VISIBLE_DEVICES": "0", "SECRET_OF_THE_WEB": "x"})
    assert proc.wait(30) == 0
    text = log_path(slurm.settings, job.id).read_text()
    assert job.env["CUDA_VISIBLE_DEVICES"] == "1"  # the request's device, replaced by the one Slurm allocated
    assert f"GPU=0 TOKEN=- CWD={slurm.settings.sd_scripts_dir}" in text

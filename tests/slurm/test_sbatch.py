"""The submission: sbatch's flags, the batch script (three fixed lines) and the job's spec it runs
`python -m lora_worker.run.node` on, which records the trainer's exact status (sacct truncates above 127; a
shell cannot tell exit 200 from a signal), surviving a SIGTERM; and the files in slurm_log_dir, each made
O_EXCL and never through a link."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from lora_worker.slurm.sbatch import job_name, log_path, rc_path, refusal_path, script_path, spec_path
from tests.helpers import make_dataset, payload, wait_for
from tests.slurm.fakes import SlurmWorker
from tests.slurm.fakes import run_batch_script, with_argv


def test_sbatch_gets_the_fixed_flags_and_the_tiers_limits(slurm: SlurmWorker):
    job = slurm.submit(tier="balanced")
    s = slurm.settings
    options = slurm.scheduler.options[job.slurm_job_id]
    assert options[:5] == ["--parsable", "--no-requeue", "--gres=gpu:1", "--partition=gpu",
                           f"--time={s.slurm_time_limit_min['balanced']}"]
    assert f"--mem={s.slurm_mem_mb['balanced']}" in options and f"--job-name={job_name(s, job.id)}" in options
    assert f"--output={log_path(s, job.id)}" in options and "--open-mode=append" in options
    script = slurm.scheduler.scripts[job.slurm_job_id]
    assert script.read_text().startswith("#!/bin/sh\n") and os.access(script, os.X_OK)
    assert slurm.scheduler.args[job.slurm_job_id] == [str(spec_path(s, job.id))]


def test_the_batch_script_holds_no_value_of_the_job(slurm: SlurmWorker):
    """argv, env and paths travel as data (the spec), never as source text."""
    one, two = slurm.submit(0), slurm.submit(1, output_name="other_name")
    texts = {slurm.scheduler.scripts[j.slurm_job_id].read_text() for j in (one, two)}
    assert len(texts) == 1 and "ohwx" not in texts.pop()
    spec = json.loads(spec_path(slurm.settings, one.id).read_text())
    assert spec["job"]["argv"] == one.argv and spec["job"]["env"] == one.env


def test_a_job_name_is_unique_to_the_worker_and_the_job(slurm: SlurmWorker):
    s = slurm.settings
    assert job_name(s, 7) != job_name(s, 8)
    assert job_name(s, 7) != job_name(s.with_overrides(state_dir=s.state_dir / "other"), 7)


@pytest.mark.parametrize("planted", ["sbatch", "log", "job.json"])
def test_a_link_at_the_next_jobs_file_refuses_the_launch_and_writes_nothing_through_it(slurm: SlurmWorker,
                                                                                     planted: str):
    slurm.settings.slurm_logs.mkdir(parents=True, exist_ok=True)
    victim = slurm.settings.state_dir / "victim"
    victim.write_text("precious\n")
    (slurm.settings.slurm_logs / f"1.{planted}").symlink_to(victim)
    answer = slurm.client.post("/train", json=payload(slurm.host.dataset, slurm.host.model))
    assert answer.status_code == 503 and answer.get_json()["error"] == "launch_failed"
    assert victim.read_text() == "precious\n"  # not truncated, not written
    assert slurm.scheduler.scripts == {}  # nothing was submitted


@pytest.mark.slow
def test_a_link_at_the_rc_name_is_not_written_through(slurm: SlurmWorker):
    job = slurm.submit()
    victim = slurm.settings.state_dir / "victim"
    victim.write_text("precious\n")
    rc_path(slurm.settings, job.id).symlink_to(victim)
    assert run_batch_script(slurm.scheduler.scripts[job.slurm_job_id], slurm.scheduler.args[job.slurm_job_id],
                            log_path(slurm.settings, job.id)) == 0
    assert victim.read_text() == "precious\n"
    assert "cannot record the return code" in log_path(slurm.settings, job.id).read_text()


@pytest.mark.slow
def test_a_node_whose_output_is_not_the_workers_log_file_refuses_to_start_the_trainer(slurm: SlurmWorker,
                                                                                      tmp_path):
    job = slurm.submit()
    elsewhere = tmp_path / "elsewhere.log"
    assert run_batch_script(slurm.scheduler.scripts[job.slurm_job_id], slurm.scheduler.args[job.slurm_job_id],
                            elsewhere) == 1
    assert "is not the log file the worker made" in refusal_path(slurm.settings, job.id).read_text()
    assert not rc_path(slurm.settings, job.id).exists() and not os.path.exists(job.lora_file)


@pytest.mark.slow
def test_a_train_id_outside_the_bmp_runs_on_slurm_as_locally(slurm: SlurmWorker):
    dataset = make_dataset(slurm.settings.train_root, train_id="t\U0001f600")
    answer = slurm.client.post("/train", json=payload(dataset, slurm.host.model))
    assert answer.status_code == 202, answer.get_json()
    job = slurm.job(answer.get_json()["worker_job_id"])
    assert "\U0001f600" in job.output_dir
    sid = job.slurm_job_id
    assert run_batch_script(slurm.scheduler.scripts[sid], slurm.scheduler.args[sid],
                            log_path(slurm.settings, job.id)) == 0
    assert rc_path(slurm.settings, job.id).read_text() == "0\n"
    assert os.path.isfile(job.lora_file)


def run_script(slurm: SlurmWorker, argv: list[str], env: dict | None = None) -> tuple[subprocess.Popen, object]:
    job = slurm.submit()
    with_argv(slurm.settings, job.id, argv)
    out = log_path(slurm.settings, job.id).open("ab")
    proc = subprocess.Popen([str(script_path(slurm.settings, job.id)), str(spec_path(slurm.settings, job.id))],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
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
    proc, job = run_script(slurm, ["/usr/bin/python3", "-c", "import time; print('up', flush=True); time.sleep(60)"])
    wait_for(lambda: b"up" in log_path(slurm.settings, job.id).read_bytes(), what="the trainer to start")
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 1
    assert rc_path(slurm.settings, job.id).read_text() == "-15\n"
    assert "trainer ended with return code -15" in log_path(slurm.settings, job.id).read_text()


@pytest.mark.slow
def test_the_trainer_gets_the_stored_env_and_slurms_gpu(slurm: SlurmWorker):
    proc, job = run_script(slurm, ["/usr/bin/python3", "-c",
                                   "import os; print('GPU=' + os.environ['CUDA_VISIBLE_DEVICES'],"
                                   " 'TOKEN=' + os.environ.get('SECRET_OF_THE_WEB', '-'), 'CWD=' + os.getcwd())"],
                           env={"CUDA_VISIBLE_DEVICES": "0", "SECRET_OF_THE_WEB": "x"})
    assert proc.wait(30) == 0
    text = log_path(slurm.settings, job.id).read_text()
    assert "CUDA_VISIBLE_DEVICES" not in job.env  # the row names no card of this host: the node's Slurm says which
    assert f"GPU=0 TOKEN=- CWD={slurm.settings.sd_scripts_dir}" in text


@pytest.mark.slow
def test_without_a_gpu_from_slurm_the_requests_device_is_not_what_the_trainer_sees(slurm: SlurmWorker):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    job = slurm.submit()
    with_argv(slurm.settings, job.id, ["/usr/bin/python3", "-c", "import os; print('GPU=' + os.environ.get("
                                       "'CUDA_VISIBLE_DEVICES', 'unset'))"])
    spec = json.loads(spec_path(slurm.settings, job.id).read_text())
    spec["job"]["env"]["CUDA_VISIBLE_DEVICES"] = "1"  # as a row dispatched before the env followed the backend
    spec_path(slurm.settings, job.id).write_text(json.dumps(spec))
    with log_path(slurm.settings, job.id).open("ab") as out:
        assert subprocess.run([str(script_path(slurm.settings, job.id)), str(spec_path(slurm.settings, job.id))],
                              stdout=out, stderr=subprocess.STDOUT, env=env, timeout=60).returncode == 0
    assert "GPU=unset" in log_path(slurm.settings, job.id).read_text()

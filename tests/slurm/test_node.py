"""On the node (run/node.py, as the batch script runs it): the local supervisor's pre-exec look and sandbox.
Whatever moved in the train root while the job pended stops it before the trainer runs (`launch_error`);
without bubblewrap on the node the trainer does not start either; with it, the trainer sees only its paths."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lora_worker.host import sandbox
from lora_worker.slurm.sbatch import log_path, rc_path, refusal_path, spec_path
from tests.helpers import Host, make_dataset, set_modes
from tests.slurm.fakes import SlurmWorker, close_worker, slurm_worker
from tests.slurm.fakes import run_batch_script

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_executable() is None, reason="bubblewrap is not installed")


def on_the_node(slurm: SlurmWorker, job) -> int:
    sid = job.slurm_job_id
    return run_batch_script(slurm.scheduler.scripts[sid], slurm.scheduler.args[sid], log_path(slurm.settings, job.id))


def ends_launch_error(slurm: SlurmWorker, job) -> str:
    slurm.scheduler.set(job.slurm_job_id, "FAILED", code=1, signal=0)
    slurm.cycles(2)
    row = slurm.job(job.id)
    assert (row.status, row.failure_class) == ("failed", "launch_error"), row.error
    return row.error


@pytest.mark.slow
def test_a_dataset_swapped_for_a_link_while_the_job_pends_ends_launch_error_and_the_trainer_never_runs(
        slurm: SlurmWorker):
    record = slurm.host.root / "record.json"
    set_modes(slurm.settings.sd_scripts_dir, record=str(record))
    job = slurm.submit()
    other = make_dataset(slurm.settings.train_root, train_id="t2")  # another train id's images and captions
    moved = Path(job.dataset_dir)
    moved.rename(moved.parent / "dataset.orig")
    moved.symlink_to(other)
    assert on_the_node(slurm, job) == 1
    assert not record.exists() and not rc_path(slurm.settings, job.id).exists()  # the trainer never started
    error = ends_launch_error(slurm, job)
    assert "dataset_dir" in error and "without following links" in error, error


@pytest.mark.slow
def test_a_link_planted_at_the_lora_path_while_the_job_pends_is_never_written_through(slurm: SlurmWorker):
    job = slurm.submit()
    victim = slurm.settings.state_dir / "victim.safetensors"
    victim.write_bytes(b"precious")
    os.symlink(victim, job.lora_file)
    assert on_the_node(slurm, job) == 1
    assert victim.read_bytes() == b"precious"
    assert "appeared in output_dir" in refusal_path(slurm.settings, job.id).read_text()
    ends_launch_error(slurm, job)


@pytest.fixture
def boxed(host: Host):
    worker, app = slurm_worker(host, sandbox="bwrap")
    yield worker
    close_worker(worker, app)


@pytest.mark.slow
def test_without_bubblewrap_on_the_node_the_trainer_does_not_start(boxed: SlurmWorker):
    record = boxed.host.root / "record.json"
    set_modes(boxed.settings.sd_scripts_dir, record=str(record))
    job = boxed.submit()  # the worker's host needs no bwrap under Slurm: the node does
    code = ("import sys; from lora_worker.host import sandbox; sandbox.bwrap_executable = lambda: None; "
            "from lora_worker.run.node import main; sys.exit(main(sys.argv[1:]))")
    with log_path(boxed.settings, job.id).open("ab") as out:
        assert subprocess.run([sys.executable, "-c", code, str(spec_path(boxed.settings, job.id))], stdout=out,
                              stderr=subprocess.STDOUT, timeout=60, check=False).returncode == 1
    assert not record.exists()
    error = ends_launch_error(boxed, job)
    assert "bwrap" in error and "not installed" in error and "apt-get install bubblewrap" in error, error


@pytest.mark.slow
@needs_bwrap
def test_on_the_node_the_trainer_runs_in_the_jobs_sandbox(boxed: SlurmWorker):
    token = boxed.settings.state_dir / "api_token"
    token.write_text("x" * 40)
    (boxed.host.sd_scripts / "sdxl_train_network.py").write_text(textwrap.dedent(f"""
        import json, os, sys, tomllib
        args = dict(a[2:].split('=', 1) for a in sys.argv[1:] if '=' in a)
        with open(args["dataset_config"], "rb") as fh:  # bound read-only at its path (docs/resume.md)
            image_dir = tomllib.load(fh)["datasets"][0]["subsets"][0]["image_dir"]
        seen = {{"token": os.path.exists({str(token)!r}),
                "ledger": os.path.exists({str(boxed.settings.database_path)!r}),
                "spec": os.path.exists({str(spec_path(boxed.settings, 1))!r}),
                "processes": len([p for p in os.listdir("/proc") if p.isdigit()]),
                "dataset": sorted(os.listdir(os.path.dirname(image_dir)))}}
        with open(os.path.join(args["output_dir"], "seen.json"), "w") as fh:
            json.dump(seen, fh)
    """))
    job = boxed.submit()
    assert job.id == 1 and on_the_node(boxed, job) == 0
    seen = json.loads((Path(job.output_dir) / "seen.json").read_text())
    assert seen == {"token": False, "ledger": False, "spec": False, "processes": 3, "dataset": ["10_ohwx woman"]}
    assert "sandbox: bwrap (" in log_path(boxed.settings, job.id).read_text()

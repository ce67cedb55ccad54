"""The Slurm launch on the real single-node cluster: on the node, the pre-exec look and the sandbox of the local
path (run/node.py), for jobs held pending while the train root changes under them; a train id outside the BMP;
an sbatch whose answer is lost after slurmctld queued the job."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lora_worker.host import sandbox
from lora_worker.slurm.sbatch import job_name
from tests.cluster.cluster import Cluster
from tests.cluster.worker import fill_node
from tests.cluster.worker import Worker, start_worker
from tests.helpers import make_dataset, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def new_worker(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Worker]]:
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    made: list[Worker] = []

    def make(**overrides: object) -> Worker:
        made.append(start_worker(cluster, tmp_path, **overrides))
        return made[-1]
    yield make
    for w in made:
        w.close()


def pending(worker: Worker, cluster: Cluster, tmp_path: Path) -> tuple[int, list[str]]:
    blockers = fill_node(cluster, tmp_path)
    job_id = worker.post()
    worker.wait(job_id, lambda j: j["queue_reason"] == "Resources", 30, "the job to pend for a GPU")
    return job_id, blockers


def test_a_dataset_swapped_for_a_link_while_the_job_pends_ends_launch_error_and_the_trainer_never_runs(
        new_worker: Callable[..., Worker], cluster: Cluster, tmp_path: Path) -> None:
    worker = new_worker()
    worker.modes(record=str(worker.host.root / "record.json"))
    job_id, blockers = pending(worker, cluster, tmp_path)
    try:
        other = make_dataset(worker.settings.train_root, train_id="t2")  # another train id's captions
        worker.host.dataset.rename(worker.host.dataset.parent / "dataset.orig")
        worker.host.dataset.symlink_to(other)
    finally:
        cluster.run("scancel", *blockers, check=False)
    job = worker.ended(job_id, timeout=60)
    assert (job["status"], job["failure_class"]) == ("failed", "launch_error"), job
    assert "The node did not start the trainer" in job["error"] and "dataset_dir" in job["error"], job["error"]
    assert not (worker.host.root / "record.json").exists()  # the trainer never started


@pytest.mark.skipif(sandbox.bwrap_executable() is None, reason="bubblewrap is not installed")
def test_a_link_planted_at_the_lora_path_while_the_job_pends_writes_nothing_through_it(
        new_worker: Callable[..., Worker], cluster: Cluster, tmp_path: Path) -> None:
    worker = new_worker(sandbox="bwrap")
    job_id, blockers = pending(worker, cluster, tmp_path)
    victim = worker.settings.state_dir / "victim.safetensors"
    try:
        victim.write_bytes(b"precious")
        lora = Path(worker.get(job_id)["output_dir"]) / "ohwx_lora.safetensors"
        os.symlink(victim, lora)
    finally:
        cluster.run("scancel", *blockers, check=False)
    job = worker.ended(job_id, timeout=60)
    assert (job["status"], job["failure_class"]) == ("failed", "launch_error"), job
    assert "appeared in output_dir" in job["error"], job["error"]
    assert victim.read_bytes() == b"precious"


@pytest.mark.skipif(sandbox.bwrap_executable() is None, reason="bubblewrap is not installed")
def test_a_train_id_outside_the_bmp_trains_in_the_sandbox_on_the_node(new_worker: Callable[..., Worker]) -> None:
    worker = new_worker(sandbox="bwrap")
    dataset = make_dataset(worker.settings.train_root, train_id="t\U0001f600")
    answer = worker.client.post("/train", json=worker.host.payload(dataset_dir=str(dataset),
                                                                   output_dir=str(dataset.parent / "output")))
    assert answer.status_code == 202, answer.get_json()
    job_id = answer.get_json()["worker_job_id"]
    worker.submitted.append(job_id)
    job = worker.ended(job_id, timeout=90)
    assert job["status"] == "succeeded", job
    assert "sandbox: bwrap (" in worker.slurm_log(job_id)


def test_an_sbatch_that_queued_the_job_then_failed_leaves_it_followed_not_running_alone(
        new_worker: Callable[..., Worker], cluster: Cluster, tmp_path: Path) -> None:
    bins = tmp_path / "slurm-bin"
    bins.mkdir()
    for name in ("squeue", "sacct", "scancel", "scontrol", "srun"):
        (bins / name).symlink_to(cluster.bin_dir / name)
    (bins / "sbatch").write_text(f"#!/bin/sh\n{cluster.bin_dir / 'sbatch'} \"$@\" >/dev/null\n"
                                 "echo 'sbatch: error: Batch job submission failed: Socket timed out' >&2\nexit 1\n")
    (bins / "sbatch").chmod(0o755)
    worker = new_worker(slurm_bin_dir=bins)
    job_id = worker.post()
    job = worker.ended(job_id, timeout=90)
    assert job["status"] == "succeeded" and job["slurm_job_id"], job  # adopted by its name, followed to the end
    name, sid = job_name(worker.settings, job_id), str(job["slurm_job_id"])
    # One job of that name on the cluster: this one. slurmctld knows at once (squeue lists ended jobs for
    # MinJobAge); slurmdbd gets the record from slurmctld's agent, so sacct may list it a while later.
    queued = cluster.run("squeue", "--noheader", "--states=all", f"--name={name}", "--format=%i")
    assert queued.stdout.split() == [sid]

    def accounted() -> list[str]:
        return cluster.run("sacct", "-n", "-X", "-P", f"--name={name}", "-o", "JobID").stdout.split()
    assert wait_for(accounted, timeout=30, what=f"slurmdbd's record of job {sid}") == [sid]

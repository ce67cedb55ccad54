"""The worker with backend = "slurm" against the real single-node cluster (tests/cluster/cluster.py), through its
HTTP API, running the fake trainer: each row of docs/reference/slurm.md's state table that a worker can
meet, as it happens for real. The poller, sbatch, squeue, sacct, scancel and the batch script are all real.

One job runs into its 1-minute time limit in the background from the start of the module (Slurm enforces
the limit only every 30 s or so), while the other tests use the second GPU; the lost-node test, which takes
the whole node down, waits for it to end first.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lora_worker.config import TIERS
from lora_worker.host.safetensors import verify_lora
from tests.helpers import make_host, pid_alive, wait_for
from tests.helpers.ledger import migrated_ledger
from tests.helpers.service import Service
from tests.cluster.cluster import Cluster
from tests.cluster.worker import (TERMINAL, fill_node, Worker, slurm_settings, start_worker, stop_poller)

pytestmark = pytest.mark.slow

TIME_LIMIT_MIN = 1


@pytest.fixture
def new_worker(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Worker]]:
    """Makes the test's worker (settings overridden as asked); closes it after the test."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))  # the poller the app starts inherits it
    made: list[Worker] = []

    def make(**overrides: object) -> Worker:
        made.append(start_worker(cluster, tmp_path, **overrides))
        return made[-1]
    yield make
    for w in made:
        w.close()


@pytest.fixture
def worker(new_worker: Callable[..., Worker]) -> Worker:
    return new_worker()


@pytest.fixture(scope="module", autouse=True)
def time_limited(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, int]]:
    """A job held in training forever, with a 1-minute --time: Slurm must end it TIMEOUT."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(cluster.conf))
    w = start_worker(cluster, tmp_path_factory.mktemp("time_limited"),
                     slurm_time_limit_min={t: TIME_LIMIT_MIN for t in TIERS})
    w.modes(hold_at_step=3, release_file=str(w.host.root / "never"))
    job_id = w.post()
    try:
        yield w, job_id
    finally:
        w.close()
        mp.undo()


def assert_no_process_left(w: Worker, slurm_job_id: str) -> None:
    wait_for(lambda: not w.job_processes(slurm_job_id), timeout=15,
             what=f"no process of Slurm job {slurm_job_id} on the node")


UNSETTLED = ("", "PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "COMPLETING", "CONFIGURING")


def sacct(cluster: Cluster, slurm_job_id: str, timeout: float = 30) -> str:
    """slurmdbd's `State|ExitCode` of an ended job. slurmctld's agent sends the record on its own time, so
    sacct may not know the end (or the job) yet when the worker, which asks squeue first, has seen it: wait for
    a terminal state, then answer whatever sacct last said."""
    deadline = time.monotonic() + timeout
    while True:
        said = cluster.run("sacct", "-n", "-X", "-P", "-j", slurm_job_id, "-o", "State,ExitCode").stdout.strip()
        if said.split("|")[0].split(" ")[0] not in UNSETTLED or time.monotonic() > deadline:
            return said
        time.sleep(0.2)


# -- it works --------------------------------------------------------------------------------------------------

def test_a_job_dispatched_over_http_ends_succeeded_with_a_verified_lora(cluster: Cluster, tmp_path: Path) -> None:
    settings = slurm_settings(cluster, tmp_path)
    host = make_host(tmp_path, **{k: v for k, v in settings.items() if k not in ("slurm_mem_mb",
                                                                                  "slurm_time_limit_min")})
    tables = {"LORA_WORKER_SLURM_MEM_MB": json.dumps(settings["slurm_mem_mb"]),
              "LORA_WORKER_SLURM_TIME_LIMIT_MIN": json.dumps(settings["slurm_time_limit_min"])}
    migrated_ledger(host.settings.database_path)
    service = Service(host.settings, tmp_path / "gunicorn.log", extra_env={"SLURM_CONF": str(cluster.conf),
                                                                           **tables}).start()
    try:
        status, body, _ = service.request("POST", "/train", host.payload())
        assert status == 202, body
        job_id = body["worker_job_id"]
        deadline, job = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            _, job, _ = service.request("GET", f"/train/{job_id}")
            if job["status"] in TERMINAL:
                break
            time.sleep(0.2)
        assert job["status"] == "succeeded", (job, (tmp_path / "gunicorn.log").read_text()[-2000:])
        assert job["backend"] == "slurm" and job["slurm_job_id"] and job["queue_reason"] is None
        assert job["step"] == job["total_steps"] == TIERS["fast"].max_train_steps
        path = Path(job["lora_path"])
        assert hashlib.sha256(path.read_bytes()).hexdigest() == job["lora_sha256"]
        from lora_worker.transcript.outcome import recorded_lora
        from lora_worker.ledger import repository as repo
        from lora_worker.ledger.db import Database
        db = Database.open(host.settings.database_path)
        try:
            check = verify_lora(path, recorded_lora(repo.get_job(db, job_id)))
        finally:
            db.dispose()
        assert check.problem is None and check.sha256 == job["lora_sha256"]
        assert sacct(cluster, str(job["slurm_job_id"])) == "COMPLETED|0:0"
        _, points, _ = service.request("GET", f"/train/{job_id}/progress?points=1000")
        assert points["points"][-1]["step"] == TIERS["fast"].max_train_steps
        _, logged, _ = service.request("GET", f"/train/{job_id}/log?lines=400")
        assert "\nmodel saved.\n" in logged["text"], logged
    finally:
        service.stop()
        stop_poller(host.settings)


def test_a_job_that_saves_and_ends_between_two_polls_keeps_saving_as_the_phase_it_ended_in(
        new_worker: Callable[..., Worker]) -> None:
    # As a local job does (README, API: "saving after a success"): the row's phase is the one the log ended in, not
    # the one the last poll before the end happened to see.
    worker = new_worker(slurm_poll_interval_s=3.0)
    release = worker.host.root / "release"
    worker.modes(hold_at_step=399, release_file=str(release))
    job_id = worker.post()
    worker.wait(job_id, lambda j: j["phase"] == "training" and j["step"] == 398, 60, "step 398")
    release.touch()  # the last step, the save and the exit take well under one poll interval
    job = worker.ended(job_id, timeout=30)
    assert (job["status"], job["phase"], job["ended_in_phase"]) == ("succeeded", "saving", "saving"), job


# -- the trainer's own failures --------------------------------------------------------------------------------

def test_a_trainer_failure_on_slurm_takes_its_class_from_the_log(worker: Worker, cluster: Cluster) -> None:
    worker.modes(oom_at_step=3)
    job_id = worker.post()
    job = worker.ended(job_id)
    assert (job["status"], job["failure_class"], job["exit_code"]) == ("failed", "cuda_oom", 1), job
    assert job["error"].startswith("torch.OutOfMemoryError: CUDA out of memory."), job["error"]
    assert sacct(cluster, str(job["slurm_job_id"])) == "FAILED|1:0"


def test_a_trainer_killed_from_outside_fails_killed_by_signal_with_its_own_signal(worker: Worker,
                                                                               cluster: Cluster) -> None:
    worker.modes(hold_at_step=3, release_file=str(worker.host.root / "never"),
                 record=str(worker.host.root / "record.json"))
    job_id = worker.post()
    worker.in_phase(job_id, "training")
    os.kill(worker.record()["pid"], signal.SIGKILL)
    job = worker.ended(job_id)
    assert (job["status"], job["failure_class"], job["signal"]) == ("failed", "killed_by_signal", 9), job
    assert sacct(cluster, str(job["slurm_job_id"])) == "FAILED|1:0"  # the trainer's own status is the .rc's


def test_a_job_over_its_memory_limit_fails_out_of_memory(new_worker: Callable[..., Worker],
                                                         cluster: Cluster) -> None:
    worker = new_worker(slurm_mem_mb={t: 200 for t in TIERS})
    worker.modes(load_mb=600)  # while loading the model, as the real trainer holds the checkpoint in RAM
    job_id = worker.post()
    job = worker.ended(job_id)
    assert (job["status"], job["failure_class"]) == ("failed", "out_of_memory"), job
    assert "OUT_OF_MEMORY" in job["error"] and "--mem" in job["error"], job["error"]
    assert sacct(cluster, str(job["slurm_job_id"])).startswith("OUT_OF_MEMORY|")
    assert_no_process_left(worker, str(job["slurm_job_id"]))


# -- cancels ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("phase, modes", [
    ("loading_model", {"hang_in": "loading_model"}),
    ("caching_latents", {"hang_in": "caching_latents"}),
    # A grandchild in a session of its own that ignores SIGTERM: only the job's cgroup finds it, and KILL ends it.
    ("training", {"hold_at_step": 3, "grandchild": "session", "grandchild_ignores_sigterm": True}),
    ("saving", {"hang_in": "saving"}),
])
def test_a_cancel_in_each_phase_ends_cancelled_and_leaves_no_process_on_the_node(
        worker: Worker, cluster: Cluster, phase: str, modes: dict) -> None:
    worker.modes(release_file=str(worker.host.root / "never"), **modes)
    job_id = worker.post()
    # The final save's phase, not a step checkpoint's: those pass through `saving` too, back to training at the
    # next redraw (SAVE_EVERY_N_STEPS).
    worker.wait(job_id, lambda j: j["status"] == "running" and j["phase"] == phase
                and (phase != "saving" or j["step"] == j["total_steps"]), 60, f"job {job_id} running in {phase}")
    sid = worker.slurm_job_id(job_id)
    assert worker.job_processes(sid)
    assert worker.cancel(job_id)["cancel_requested_at"] is not None
    job = worker.ended(job_id, timeout=30)
    assert (job["status"], job["phase"]) == ("cancelled", phase), job
    # The worker signals (scancel --signal=TERM --full), it does not cancel: the batch script outlives the
    # trainer, records how it ended and exits 1, so Slurm's record is FAILED while the row says cancelled.
    assert sacct(cluster, sid) == "FAILED|1:0"
    assert_no_process_left(worker, sid)


def test_with_both_gpus_taken_a_job_is_queued_with_slurms_reason_and_cancels_without_ever_running(
        worker: Worker, cluster: Cluster, tmp_path: Path) -> None:
    worker.modes(record=str(worker.host.root / "record.json"))
    blockers = fill_node(cluster, tmp_path)
    try:
        first, second = worker.post(), worker.post()
        one = worker.wait(first, lambda j: j["queue_reason"] == "Resources", 30, "Resources")
        # The second waits behind the first, which waits for the resources.
        two = worker.wait(second, lambda j: j["queue_reason"] == "Priority", 30, "Priority")
        assert one["status"] == two["status"] == "queued" and one["phase"] is None
        for job_id in (first, second):
            worker.cancel(job_id)
        for job_id in (first, second):
            job = worker.ended(job_id, timeout=30)
            assert job["status"] == "cancelled" and job["started_at"] is None, job
            assert sacct(cluster, str(job["slurm_job_id"])).startswith("CANCELLED")
    finally:
        cluster.run("scancel", *blockers, check=False)
    assert not (worker.host.root / "record.json").exists()  # the trainer never started


def test_a_cancel_the_worker_did_not_ask_for_is_a_failure_naming_slurm(worker: Worker, cluster: Cluster) -> None:
    worker.modes(hold_at_step=3, release_file=str(worker.host.root / "never"))
    job_id = worker.post()
    worker.in_phase(job_id, "training")
    sid = worker.slurm_job_id(job_id)
    cluster.run("scancel", sid)  # an operator on the cluster, not the API
    job = worker.ended(job_id, timeout=30)
    assert (job["status"], job["failure_class"]) == ("failed", "killed_by_signal"), job
    assert f"Slurm cancelled job {sid}" in job["error"], job["error"]
    assert_no_process_left(worker, sid)


# -- the cluster's own trouble ---------------------------------------------------------------------------------

def test_slurmctld_and_slurmd_restarted_mid_job_the_job_carries_on_to_success(worker: Worker,
                                                                              cluster: Cluster) -> None:
    release = worker.host.root / "release"
    worker.modes(hold_at_step=50, release_file=str(release))
    job_id = worker.post()
    worker.in_phase(job_id, "training")
    cluster.stop_daemon("slurmctld")
    cluster.stop_daemon("slurmd")
    time.sleep(2)  # a few poll cycles with Slurm unreachable: nothing may be concluded from silence
    assert worker.get(job_id)["status"] == "running"
    cluster.start_daemon("slurmctld")
    cluster.start_daemon("slurmd")
    cluster.wait_node("mixed", "allocated", timeout=30)
    release.touch()
    job = worker.ended(job_id)
    assert job["status"] == "succeeded" and job["lora_sha256"], job
    assert sacct(cluster, str(job["slurm_job_id"])) == "COMPLETED|0:0"


def test_the_poller_killed_mid_job_is_started_again_and_follows_the_job_to_its_end(worker: Worker) -> None:
    release = worker.host.root / "release"
    worker.modes(hold_at_step=50, release_file=str(release))
    job_id = worker.post()
    worker.wait(job_id, lambda j: j["status"] == "running" and (j["step"] or 0) >= 40, 60, "step 40")
    before = worker.client.get(f"/train/{job_id}/progress?points=5000").get_json()["points"]
    first = worker.poller_pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: not pid_alive(first), what="the poller to die")
    job = worker.get(job_id)  # a request that touches the job finds its poller gone and starts another
    assert job["status"] == "running", job
    second = wait_for(worker.poller_pid, what="a new poller")
    assert second != first
    release.touch()
    job = worker.ended(job_id)
    assert job["status"] == "succeeded", job
    points = worker.client.get(f"/train/{job_id}/progress?points=5000").get_json()["points"]
    steps = [p["step"] for p in points]
    assert steps == sorted(set(steps)) and steps[-1] == job["total_steps"], steps  # none twice, to the end
    kept = {p["step"]: p["loss"] for p in points}
    assert before and all(kept.get(p["step"]) == p["loss"] for p in before), (before, points)  # none lost


@pytest.mark.timeout(240)  # run alone, it waits out the whole limit and Slurm's 30 s enforcement period
def test_a_job_past_its_time_limit_fails_time_limit(time_limited: tuple[Worker, int], cluster: Cluster) -> None:
    w, job_id = time_limited
    job = w.ended(job_id, timeout=TIME_LIMIT_MIN * 60 + 60)
    assert (job["status"], job["failure_class"]) == ("failed", "time_limit"), job
    assert "TIMEOUT" in job["error"] and "--time" in job["error"], job["error"]
    assert sacct(cluster, str(job["slurm_job_id"])).startswith("TIMEOUT|")
    assert_no_process_left(w, str(job["slurm_job_id"]))


def trainer_environ(w: Worker, slurm_job_id: str) -> dict[str, str]:
    for pid in w.job_processes(slurm_job_id):
        try:
            if b"sdxl_train_network.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                raw = Path(f"/proc/{pid}/environ").read_bytes()
                env = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
                if env.get("SLURM_JOB_ID") == slurm_job_id:  # job_processes also finds the host's other trainers
                    return env
        except OSError:
            continue
    raise AssertionError(f"no trainer process of Slurm job {slurm_job_id}")


@pytest.mark.timeout(240)
def test_on_slurm_two_jobs_train_at_once_each_on_the_gpu_slurm_gave_it_and_max_active_jobs_holds(
        new_worker: Callable[..., Worker], time_limited: tuple[Worker, int]) -> None:
    other, other_id = time_limited
    other.ended(other_id, timeout=TIME_LIMIT_MIN * 60 + 60)  # both GPUs for this test
    worker = new_worker(max_active_jobs=2)
    worker.modes(hold_at_step=3, release_file=str(worker.host.root / "release"))
    first, second = worker.post(), worker.post(device_index=0)
    for job_id in (first, second):
        worker.in_phase(job_id, "training")
    devices = {trainer_environ(worker, worker.slurm_job_id(j))["CUDA_VISIBLE_DEVICES"] for j in (first, second)}
    assert devices == {"0", "1"}  # Slurm's allocation, whatever device the request named
    third = worker.client.post("/train", json=worker.host.payload(output_dir=str(worker.host.dataset.parent / "o3")))
    assert third.status_code == 409 and third.get_json()["error"] == "job_active", third.get_json()
    (worker.host.root / "release").touch()
    for job_id in (first, second):
        assert worker.ended(job_id)["status"] == "succeeded"


@pytest.mark.timeout(300)
def test_a_lost_node_fails_the_job_node_fail_and_its_trainer_does_not_outlive_the_node(
        worker: Worker, cluster: Cluster, time_limited: tuple[Worker, int]) -> None:
    other, other_id = time_limited
    other.ended(other_id, timeout=TIME_LIMIT_MIN * 60 + 60)  # only this test's job may be on the node
    worker.modes(hold_at_step=3, release_file=str(worker.host.root / "never"))
    job_id = worker.post()
    worker.in_phase(job_id, "training")
    sid = worker.slurm_job_id(job_id)
    cluster.stop_slurmd(signal.SIGKILL)
    try:
        job = worker.ended(job_id, timeout=90)
        assert (job["status"], job["failure_class"]) == ("failed", "node_fail"), job
        assert "NODE_FAIL" in job["error"], job["error"]
        assert sacct(cluster, sid).startswith("NODE_FAIL|")
        squeue = cluster.run("squeue", "-h", "-j", sid, "-o", "%T", check=False).stdout.strip()
        assert squeue in ("", "COMPLETING"), squeue  # --no-requeue: not PENDING again under the same id
    finally:
        cluster.start_slurmd()
        cluster.wait_node("idle", timeout=60)
    assert_no_process_left(worker, sid)  # the slurmd that came back killed what was left of the job

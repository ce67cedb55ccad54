"""A worker host whose backend is the test cluster: the fake trainer (tests/fakes/, as tests.helpers.make_host
installs it), sandbox none, the ledger and the app in this process (Flask's test client: the same HTTP routes
gunicorn serves), and the real detached poller, which the app starts at the first dispatch.

Each worker's Slurm log dir is a folder of its own under the cluster's shared storage. `close()` stops its
poller, cancels on the cluster whatever of its jobs is still there (so the next test finds both GPUs free)
and waits until no process of its jobs is left on the node.
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_worker.config import TIERS, Settings
from lora_worker.host.locks import lock_state
from lora_worker.slurm.process import poller_lock_path
from tests.helpers import Host, make_host, pid_alive, set_modes, wait_for
from tests.helpers.ledger import migrated_ledger
from tests.cluster.cluster import Cluster, alive

TERMINAL = ("succeeded", "failed", "cancelled")
# Per job: the node has 8000 MB (cluster.py) and runs two at a time; the fake trainer needs ~60 MB.
MEM_MB = 1000
POLL_S = 0.3


def slurm_settings(cluster: Cluster, root: Path, **overrides: Any) -> dict[str, Any]:
    logs = cluster.shared / root.name
    logs.mkdir(exist_ok=True)
    values: dict[str, Any] = {
        "backend": "slurm", "slurm_bin_dir": cluster.bin_dir, "slurm_log_dir": logs,
        "slurm_poll_interval_s": POLL_S, "slurm_mem_mb": {t: MEM_MB for t in TIERS},
        "slurm_time_limit_min": {t: 10 for t in TIERS},
    }
    values.update(overrides)
    return values


@dataclass
class Worker:
    cluster: Cluster
    host: Host
    client: Any
    app: Any
    submitted: list[int] = field(default_factory=list)
    outputs: int = 0

    @property
    def settings(self) -> Settings:
        return self.host.settings

    def modes(self, **modes: Any) -> None:
        set_modes(self.host.sd_scripts, **modes)

    def post(self, **overrides: Any) -> int:
        """Dispatch a job (each into an output dir of its own); its id."""
        self.outputs += 1
        body = self.host.payload(output_dir=str(self.host.dataset.parent / f"output{self.outputs}"), **overrides)
        answer = self.client.post("/train", json=body)
        assert answer.status_code == 202, answer.get_json()
        job_id = answer.get_json()["worker_job_id"]
        self.submitted.append(job_id)
        return job_id

    def get(self, job_id: int) -> dict[str, Any]:
        answer = self.client.get(f"/train/{job_id}")
        assert answer.status_code == 200, answer.get_json()
        return answer.get_json()

    def cancel(self, job_id: int) -> dict[str, Any]:
        answer = self.client.post(f"/train/{job_id}/cancel")
        assert answer.status_code == 202, answer.get_json()
        return answer.get_json()

    def wait(self, job_id: int, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60,
             what: str = "") -> dict[str, Any]:
        seen: list[dict[str, Any]] = []

        def check() -> dict[str, Any] | None:
            job = self.get(job_id)
            seen.append(job)
            return job if predicate(job) else None
        try:
            return wait_for(check, timeout=timeout, interval=0.1, what=what)
        except AssertionError as exc:
            last = {k: seen[-1].get(k) for k in ("status", "phase", "step", "failure_class", "error",
                                                 "slurm_job_id", "queue_reason")} if seen else None
            raise AssertionError(f"{exc}; job {job_id} last: {last}; slurm: {self.slurm_state(job_id)}; "
                                 f"log: {self.slurm_log(job_id)[-1500:]!r}") from None

    def ended(self, job_id: int, timeout: float = 60) -> dict[str, Any]:
        return self.wait(job_id, lambda j: j["status"] in TERMINAL, timeout, f"job {job_id} to end")

    def in_phase(self, job_id: int, phase: str, timeout: float = 60) -> dict[str, Any]:
        return self.wait(job_id, lambda j: j["status"] == "running" and j["phase"] == phase, timeout,
                         f"job {job_id} running in {phase}")

    def slurm_job_id(self, job_id: int) -> str:
        return str(self.wait(job_id, lambda j: j["slurm_job_id"] is not None, 30, "a Slurm job id")["slurm_job_id"])

    def slurm_state(self, job_id: int) -> str:
        job = self.client.get(f"/train/{job_id}").get_json() or {}
        sid = job.get("slurm_job_id")
        if not sid:
            return "not submitted"
        return self.cluster.run("sacct", "-n", "-X", "-P", "-j", str(sid), "-o", "State,ExitCode",
                                check=False).stdout.strip()

    def slurm_log(self, job_id: int) -> str:
        path = self.settings.slurm_logs / f"{job_id}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def record(self) -> dict[str, Any]:
        """What the fake trainer wrote at its start (the `record` mode)."""
        path = self.host.root / "record.json"
        return json.loads(wait_for(lambda: path.exists() and path.read_text(), what="the trainer's record"))

    def poller_pid(self) -> int | None:
        return lock_state(poller_lock_path(self.settings)).holder_pid

    def job_processes(self, slurm_job_id: str) -> list[int]:
        """Processes of a job on the node: its environment names the Slurm job, or its command line this host."""
        marker, tag = str(self.host.root).encode(), f"SLURM_JOB_ID={slurm_job_id}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if (marker in cmdline and b"lora_worker.slurm" not in cmdline or tag in environ.split(b"\0")) \
                    and alive(int(entry.name)):
                found.append(int(entry.name))
        return found

    def close(self) -> None:
        # Requests first: one that touches an active job while no poller runs starts a poller again.
        sids = []
        for job_id in self.submitted:
            job = self.client.get(f"/train/{job_id}").get_json() or {}
            if job.get("slurm_job_id") and job.get("status") not in TERMINAL:
                sids.append(str(job["slurm_job_id"]))
        if sids:
            self.cluster.run("scancel", "--full", "--signal=KILL", *sids, check=False)
            self.cluster.run("scancel", *sids, check=False)
            wait_for(lambda: not any(self.job_processes(s) for s in sids), timeout=30,
                     what="the worker's jobs to leave the node")
        stop_poller(self.settings)
        self.app.extensions["lora_worker"].db.dispose()


def stop_poller(settings: Settings) -> None:
    pid = lock_state(poller_lock_path(settings)).holder_pid
    if pid is not None and pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not pid_alive(pid), timeout=30, what="the poller to stop")


def start_worker(cluster: Cluster, root: Path, **overrides: Any) -> Worker:
    from lora_worker import create_app

    host = make_host(root, **slurm_settings(cluster, root, **overrides))
    migrated_ledger(host.settings.database_path)
    app = create_app(host.settings)
    app.config["TESTING"] = True
    return Worker(cluster=cluster, host=host, client=app.test_client(), app=app)


def gpus_in_use(cluster: Cluster) -> int:
    out = cluster.run("scontrol", "show", "node", cluster.node, "--oneliner").stdout
    for item in out.split():
        if item.startswith("AllocTRES="):
            for tres in item.split("=", 1)[1].split(","):
                if tres.startswith("gres/gpu="):
                    return int(tres.split("=")[1])
    return 0


def wait_gpus_in_use(cluster: Cluster, count: int, timeout: float = 30) -> None:
    wait_for(lambda: gpus_in_use(cluster) == count, timeout=timeout, interval=0.2,
             what=f"{count} GPU(s) of the node to be allocated")


def elapsed(since: float) -> float:
    return time.monotonic() - since


def fill_node(cluster: Cluster, tmp_path: Path) -> list[str]:
    """Jobs that hold every free GPU of the node (not the worker's): what else comes must wait."""
    blockers = []
    for _ in range(2 - gpus_in_use(cluster)):
        blockers.append(cluster.run("sbatch", "--parsable", "--gres=gpu:1", "--mem=10", f"--output={tmp_path}/b.log",
                                    "--wrap=sleep 300").stdout.strip())
    wait_gpus_in_use(cluster, 2)
    return blockers

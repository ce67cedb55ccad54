"""The demo on Slurm (`make demo-slurm`, or `LORA_WORKER_BACKEND=slurm make demo` against a cluster): the same
simulated host, each job an sbatch to the test cluster; it trains a verified LoRA, checks the cluster with
doctor, and leaves no poller behind once stopped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from lora_worker.config import REPO_ROOT, TIERS
from lora_worker.host.locks import is_locked
from tests.helpers import wait_for
from tests.helpers.service import free_port
from tests.cluster.cluster import Cluster

pytestmark = pytest.mark.slow


def test_the_demo_on_slurm_trains_a_verified_lora_through_the_cluster_and_stops_its_poller(
        cluster: Cluster, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA_WORKER_")}
    env.update({**cluster.env, "LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_SLURM_BIN_DIR": str(cluster.bin_dir),
                "LORA_WORKER_SLURM_MEM_MB": json.dumps({t: 1000 for t in TIERS})})
    demo = subprocess.Popen([sys.executable, "-m", "lora_worker.ops.cli", "demo", "--dir", str(tmp_path / "demo"),
                             "--bind", f"127.0.0.1:{port}", "--step-s", "0.005"], cwd=REPO_ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line or "FAILED" in line:
                break
        text = "".join(lines)
        assert "Ctrl-C stops it" in text, text
        assert "doctor [  ok] slurm sinfo" in text and "doctor [  ok] slurm proctrack: proctrack/cgroup" in text
        assert "POST /train on GPU 0" not in text  # no NVML admission to show: Slurm gives the GPU
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/train/1", timeout=10) as answer:
            job = json.loads(answer.read())
        assert (job["status"], job["backend"]) == ("succeeded", "slurm") and job["slurm_job_id"], job
        assert f"verified {job['lora_path']}" in text
        assert "export LORA_WORKER_BACKEND=slurm" in text  # the printed CLI commands name the cluster too
        demo.send_signal(signal.SIGINT)
        rest = demo.communicate(timeout=60)[0]
        assert demo.returncode == 0, text + rest
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    lock = tmp_path / "demo" / "locks" / "slurm-poller.lock"
    wait_for(lambda: not is_locked(lock), timeout=15, what="the demo's poller to stop")

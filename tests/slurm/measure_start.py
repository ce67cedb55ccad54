"""The time from `POST /train` to the trainer starting, on the real single-node Slurm against the local backend:
the same fake trainer (its `record` mode writes the wall time at its start), the same machine, the same API
(Flask's test client). For the closing note; not a test. As root, from the repository root:

    PYTHONPATH=. python -m tests.slurm.measure_start [RUNS]

Prints one JSON line per run, then the medians. The Slurm runs are taken with the poller already running (a
worker's steady state) and with the first dispatch starting it.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lora_worker.ledger.migrate import upgrade
from tests.helpers import make_host, set_modes, wait_for
from tests.slurm.cluster import Cluster
from tests.slurm.worker import TERMINAL, start_worker


def one_run(cluster: Cluster, root: Path, backend: str, poller_first: bool) -> dict[str, object]:
    from lora_worker import create_app
    from lora_worker.run.slurm.process import ensure_poller

    if backend == "slurm":
        worker = start_worker(cluster, root)
        host, client, settings = worker.host, worker.client, worker.settings
        if poller_first:
            ensure_poller(settings)
    else:
        host = make_host(root)
        settings = host.settings
        upgrade(settings.database_path)
        client = create_app(settings).test_client()
    record = root / "record.json"
    set_modes(host.sd_scripts, record=str(record))
    posted = time.time()
    answer = client.post("/train", json=host.payload())
    accepted = time.time()
    assert answer.status_code == 202, answer.get_json()
    job_id = answer.get_json()["worker_job_id"]
    wait_for(record.exists, timeout=60, interval=0.005, what="the trainer's start")
    started = json.loads(record.read_text())["t"]
    wait_for(lambda: client.get(f"/train/{job_id}").get_json()["status"] in TERMINAL, timeout=120)
    if backend == "slurm":
        worker.close()
    return {"backend": backend, "poller_running_before": poller_first if backend == "slurm" else None,
            "post_202_ms": round((accepted - posted) * 1000), "post_to_trainer_ms": round((started - posted) * 1000)}


def main(runs: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="lw-measure-", dir="/tmp"))
    base.chmod(0o755)  # munged wants every directory above its socket open to all
    cluster = Cluster(base / "cluster").start()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    results: dict[str, list[int]] = {}
    try:
        for i in range(runs):
            for backend, poller_first in (("local", False), ("slurm", True), ("slurm", False)):
                row = one_run(cluster, base / f"{backend}-{poller_first}-{i}", backend, poller_first)
                print(json.dumps(row), flush=True)
                key = backend + (" (poller running)" if poller_first else " (first dispatch)" if backend == "slurm"
                                 else "")
                results.setdefault(key, []).append(int(row["post_to_trainer_ms"]))  # type: ignore[arg-type]
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    for key, values in results.items():
        print(f"{key}: median {statistics.median(values):.0f} ms POST → trainer start over {len(values)} runs "
              f"(min {min(values)}, max {max(values)})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)

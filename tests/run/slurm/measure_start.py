"""POST /train → 202, → the trainer's first output, → the row `running`: local against Slurm on the fake
tools (tests/run/slurm/fake_slurm, which start a job at once: the worker's own part of the latency; a real
scheduler adds its own). Not a test: `PYTHONPATH=. python tests/run/slurm/measure_start.py`."""
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from tests.helpers import make_host, payload, wait_for, pid_alive
from tests.run.slurm.test_end_to_end import install_fake_slurm
from lora_worker.ledger.migrate import upgrade
from lora_worker.ledger.db import Database
from lora_worker.ledger import repository as repo
from lora_worker.host.locks import lock_state
from lora_worker.run.slurm.process import poller_lock_path
from lora_worker.run.slurm.sbatch import log_path
from lora_worker import create_app

def run(backend, first_poller):
    root = Path(tempfile.mkdtemp()); host = make_host(root, progress_interval_s=1.0)
    extra = {"backend": "slurm", "slurm_bin_dir": install_fake_slurm(root / "bin")} if backend == "slurm" else {}
    s = host.settings.with_overrides(**extra)
    upgrade(s.database_path)
    app = create_app(s); c = app.test_client(); db = Database.open(s.database_path)
    if backend == "slurm" and not first_poller:
        from lora_worker.run.slurm.process import ensure_poller; ensure_poller(s)
    t0 = time.perf_counter()
    r = c.post("/train", json=payload(host.dataset, host.model)); t1 = time.perf_counter()
    jid = r.get_json()["worker_job_id"]
    def out():
        p = log_path(s, jid) if backend == "slurm" else s.log_dir / f"job-{jid}.log"
        return p.exists() and b"loading model" in p.read_bytes()
    wait_for(out, timeout=60, interval=0.005); t2 = time.perf_counter()
    wait_for(lambda: repo.get_job(db, jid).status == "running", timeout=60, interval=0.005); t3 = time.perf_counter()
    wait_for(lambda: repo.get_job(db, jid).status not in ("queued", "running"), timeout=120, interval=0.05)
    if backend == "slurm":
        pid = lock_state(poller_lock_path(s)).holder_pid; os.kill(pid, signal.SIGTERM)
    db.dispose()
    return {"backend": backend, "poller_already_running": not first_poller if backend == "slurm" else None,
            "post_202_ms": round((t1 - t0) * 1000), "trainer_first_output_ms": round((t2 - t0) * 1000),
            "row_running_ms": round((t3 - t0) * 1000)}

for args in (("local", False), ("slurm", True), ("slurm", False), ("local", False), ("slurm", False)):
    print(json.dumps(run(*args)))

"""What the Slurm poller costs: CPU per poll cycle with N running jobs whose logs grow by 2 s of tqdm redraws
per cycle, through the real Scheduler (a fork and exec of each command; here shell scripts standing in for
squeue and sacct). Not a test: `PYTHONPATH=. python tests/run/slurm/measure_poller.py` prints JSON lines."""
import json
import os
import tempfile
import time
from pathlib import Path

from tests.helpers import make_host
from tests.run.slurm.conftest import steps_bar
from lora_worker.ledger.migrate import upgrade
from lora_worker.ledger.db import Database
from lora_worker.ledger import repository as repo
from lora_worker.run.slurm.poller import Poller
from lora_worker.run.slurm.scheduler import Scheduler
from lora_worker.run.slurm.sbatch import log_path
from tests.ledger.test_ledger import columns

for n in (1, 8):
    root = Path(tempfile.mkdtemp())
    host = make_host(root)
    bindir = root / "bin"; bindir.mkdir()
    (bindir / "squeue").write_text('#!/bin/sh\nfor a; do case "$a" in --jobs=*) ids="${a#--jobs=}";; esac; done\n'
                                   'echo "$ids" | tr , "\\n" | sed "s/$/|RUNNING|None/"\n')
    (bindir / "sacct").write_text("#!/bin/sh\nexit 0\n")
    for f in bindir.iterdir(): f.chmod(0o755)
    s = host.settings.with_overrides(backend="slurm", slurm_bin_dir=bindir, progress_interval_s=1.0)
    upgrade(s.database_path)
    db = Database.open(s.database_path)
    jobs = []
    for k in range(n):
        j = repo.create_job(db, columns(backend="slurm", slot=f"slurm-{k}"))
        repo.record_slurm_job(db, j.id, str(5000 + k))
        jobs.append(j)
    s.slurm_logs.mkdir(parents=True, exist_ok=True)
    p = Poller(s, db, Scheduler(bindir), time.monotonic)
    p.cycle()
    cycles = 50
    t0 = os.times(); w0 = time.perf_counter()
    for c in range(cycles):
        for j in jobs:  # each job's trainer wrote ~2 s of bar redraws (10/s) since the last cycle
            with log_path(s, j.id).open("a") as fh:
                fh.write("".join(steps_bar(c * 20 + i, loss=0.1) for i in range(20)))
        p.cycle()
    t1 = os.times(); w1 = time.perf_counter()
    own = (t1.user - t0.user + t1.system - t0.system) / cycles
    kids = (t1.children_user - t0.children_user + t1.children_system - t0.children_system) / cycles
    print(json.dumps({"active_jobs": n, "cpu_ms_per_cycle_poller": round(own * 1000, 2),
                      "cpu_ms_per_cycle_slurm_commands": round(kids * 1000, 2),
                      "wall_ms_per_cycle": round((w1 - w0) / cycles * 1000, 2),
                      "cpu_ms_per_job_per_cycle": round((own + kids) / n * 1000, 2)}))
    p.close(); db.dispose()

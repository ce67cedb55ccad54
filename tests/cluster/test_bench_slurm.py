"""The Slurm benchmark (bench/slurm.py) end to end at tiny sizes. It starts a real cluster of its own, so it runs
here, in the one process that runs the cluster's tests one after another: never two clusters started at once."""
from __future__ import annotations

import subprocess
import sys

import pytest

from lora_worker.config import REPO_ROOT

pytestmark = pytest.mark.slow


def test_the_slurm_benchmark_runs_and_prints_its_table():
    out = subprocess.run([sys.executable, "-m", "bench.slurm", "--quick"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "### Slurm: poller cost and POST /train → trainer started" in out.stdout
    assert "| metric | value | baseline | ratio | target | met? |" in out.stdout

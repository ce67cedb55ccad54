"""Each benchmark runs end to end at tiny sizes and prints its table. Smoke only: no number is checked here
(benchmarks report, they never fail on a number; `make bench` runs them at full size)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from lora_worker.config import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("bench, title", [
    ("stream", "### Stream overhead: CPU share in a realistic run"),
    ("status", "### Status under load"),
    ("dispatch", "### Dispatch and cancel latency"),
    ("history", "### Scale of history"),
    ("memory", "### Memory"),
])
def test_the_benchmark_runs_and_prints_its_table(bench: str, title: str):
    if bench == "status" and shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (apt-get install -y wrk)")
    out = subprocess.run([sys.executable, "-m", f"bench.{bench}", "--quick"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    assert title in out.stdout and "| metric | value | baseline | ratio | target | met? |" in out.stdout

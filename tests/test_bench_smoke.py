"""Each benchmark runs end to end at tiny sizes and prints its table. Smoke only: no number is checked here
(benchmarks report, they never fail on a number; `make bench` runs them at full size). The Slurm benchmark starts
a cluster of its own: its smoke test is tests/cluster/test_bench_slurm.py, in the cluster's one process."""
from __future__ import annotations

import json
import os
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
    ("webhooks", "### Webhooks: what the outbox adds, and the sender's CPU per event"),
])
def test_the_benchmark_runs_and_prints_its_table(bench: str, title: str):
    out = subprocess.run([sys.executable, "-m", f"bench.{bench}", "--quick"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    assert title in out.stdout and "| metric | value | baseline | ratio | target | met? |" in out.stdout


def test_every_row_a_benchmark_prints_is_written_as_data(tmp_path, monkeypatch):
    from bench.common import JSON_ENV, Row, emit

    rows = tmp_path / "rows.jsonl"
    monkeypatch.setenv(JSON_ENV, str(rows))
    emit("Stream", [Row("flood", "1.2 ms", "0.9 ms", 1.33, "≤ 1.5×", True),
                    Row("growth", "172,032 bytes")])
    first, second = [json.loads(line) for line in rows.read_text().splitlines()]
    assert first == {"bench": "Stream", "metric": "flood", "value": 1.2, "unit": "ms", "value_text": "1.2 ms",
                     "baseline": 0.9, "baseline_unit": "ms", "baseline_text": "0.9 ms", "ratio": 1.33,
                     "target": "≤ 1.5×", "met": True}
    assert (second["value"], second["unit"], second["baseline"], second["met"]) == (172032.0, "bytes", None, None)


def test_bench_json_collects_the_rows_of_every_benchmark_into_one_file(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-c", "import sys, bench.__main__ as m; m.BENCHES = ('history',); "
                           "sys.exit(m.main(sys.argv[1:]))", "--quick", "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["arguments"] == ["--quick"]
    benches = {m["bench"] for m in report["metrics"]}
    assert benches == {"Scale of history"} and len(report["metrics"]) >= 3
    assert all(set(m) >= {"value", "baseline", "ratio", "target", "met"} for m in report["metrics"])


def test_the_eta_replay_records_its_errors_as_data_too(tmp_path):
    from bench.common import JSON_ENV

    rows = tmp_path / "rows.jsonl"
    out = subprocess.run([sys.executable, "-m", "bench.eta_replay", "--quick"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=110, env={**os.environ, JSON_ENV: str(rows)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "### ETA on the real captures" in out.stdout
    records = [json.loads(line) for line in rows.read_text().splitlines()]
    assert len(records) == 6 and {r["bench"] for r in records} == {"ETA on the real captures"}  # 2 histories × 3
    assert all(r["unit"] == "s" or r["value_text"] == "null" for r in records)
    assert any(r["value"] is not None for r in records)

"""`python -m bench` (what `make bench` runs): every benchmark in turn, each printing its table.

`--json FILE` also writes every row of every table to FILE as data: value, baseline, ratio, target and met
(true, false, or null where a row only reports). Any other argument (e.g. `--quick`) is passed to each
benchmark. A benchmark that fails is reported and the others still run; the exit status says whether all of
them ran, never whether a target was met.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import JSON_ENV

BENCHES = ("stream", "status", "dispatch", "history", "memory", "eta_replay", "supervisor", "slurm", "webhooks")


def main(argv: list[str]) -> int:
    json_file, argv = _take_json(argv)
    with tempfile.TemporaryDirectory(prefix="lora-bench-json-") as tmp:
        rows = Path(tmp) / "rows.jsonl"
        env = {**os.environ, JSON_ENV: str(rows)} if json_file else None
        failed = [name for name in BENCHES
                  if subprocess.run([sys.executable, "-m", f"bench.{name}", *argv], env=env).returncode != 0]
        if json_file:
            metrics = [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []
            report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": _machine(),
                      "arguments": argv, "failed": failed, "metrics": metrics}
            Path(json_file).write_text(json.dumps(report, indent=2) + "\n")
    if failed:
        print(f"benchmarks that did not run to the end: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _take_json(argv: list[str]) -> tuple[str | None, list[str]]:
    if "--json" not in argv:
        return None, argv
    i = argv.index("--json")
    if i + 1 >= len(argv):
        sys.exit("usage: python -m bench [--json FILE] [--quick]")
    return argv[i + 1], argv[:i] + argv[i + 2:]


def _machine() -> dict[str, object]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

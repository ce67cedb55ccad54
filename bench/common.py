"""What every benchmark shares: a worker host on disk, per-process counters from /proc, and the result table.

Benchmarks report; they never fail on a number. Each prints one markdown table whose rows carry the value,
the baseline measured in the same run, their ratio, the target and whether it is met.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_worker.config import REPO_ROOT
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import upgrade
from tests.helpers import Host, make_host, wait_for
from tests.helpers.service import Service

BENCH_DIR = Path(__file__).resolve().parent
CAPTURE = REPO_ROOT / "tests" / "data" / "run1_simple.jsonl"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- the host -----------------------------------------------------------------------------------------------

@contextmanager
def bench_host(**settings: Any) -> Iterator[Host]:
    """A migrated worker host in a temporary directory, with the production supervision intervals unless
    `settings` says otherwise (the test defaults poll ten times faster, which is not what we measure)."""
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        values = {"progress_interval_s": 1.0, "cancel_grace_s": 20.0, "launch_grace_s": 30.0, **settings}
        host = make_host(Path(tmp), **values)
        upgrade(host.settings.database_path)
        yield host


@contextmanager
def running_service(host: Host) -> Iterator[Service]:
    """gunicorn with the shipped configuration on this host (tests/helpers/service.py), stopped afterwards."""
    svc = Service(host.settings, host.root / "gunicorn.log").start()
    try:
        yield svc
    finally:
        svc.stop()


def insert_job(db: Database, argv: list[str], train_root: Path, **columns: Any) -> int:
    """A queued job whose trainer is `argv` (an emitter instead of sd-scripts); returns its id. Its dataset and
    output folders exist under `train_root`, as dispatch leaves them: the supervisor looks at them once more
    before it starts the trainer."""
    dataset, output = train_root / "t1" / "dataset", train_root / "t1" / "output"
    (dataset / "10_ohwx woman").mkdir(parents=True, exist_ok=True)
    output.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {
        "train_id": "t1", "dataset_dir": str(dataset), "base_model_path": "/models/m.safetensors",
        "output_dir": str(output), "output_name": f"ohwx-{time.time_ns()}", "trigger": "ohwx",
        "subject_class": "woman", "repeats": 10, "tier": "quality", "device_index": 1, "seed": 42,
        "image_count": 30, "argv": argv,
        "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"},
        "total_steps": 3000, "lora_rank": 32, "lora_steps": 3000, "lora_dtype": "F32", **columns,
    }
    values.setdefault("lora_file", str(output / f"{values['output_name']}.safetensors"))
    return repo.create_job(db, values).id


def supervisor_pid(db: Database, job_id: int, timeout: float = 30.0) -> int:
    """The pid the supervisor recorded when it took the job."""
    return wait_for(lambda: (job := repo.find_job(db, job_id)) is not None and job.supervisor_pid,
                    timeout=timeout, interval=0.005, what=f"job {job_id}'s supervisor")


# -- one process, from /proc --------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """On-CPU time of the process's main thread, in ns resolution (schedstat; still readable as a zombie).

    /proc/<pid>/stat would give user+system in 10 ms ticks, too coarse for a 50 ms baseline. Every process
    measured here is single-threaded (`threads` checks it)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def threads(pid: int) -> int:
    return int(_status_field(pid, "Threads") or 0)


def peak_rss_mib(pid: int) -> float:
    """VmHWM: the resident set's high-water mark (gone once the process is a zombie)."""
    kib = _status_field(pid, "VmHWM")
    return int(kib.split()[0]) / 1024 if kib else 0.0


def read_syscalls(pid: int) -> int:
    """read() calls made so far (/proc/<pid>/io syscr): shows two readers took the pipe in the same chunks."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    return 0


def state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2]


def _status_field(pid: int, name: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


# -- numbers and the table ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One line of a result table. `ratio` is value / baseline; `met` is None where there is no target."""

    metric: str
    value: str
    baseline: str = "–"
    ratio: float | None = None
    target: str = "–"
    met: bool | None = None


def render_table(title: str, rows: list[Row], notes: list[str] = ()) -> str:  # type: ignore[assignment]
    lines = [f"### {title}", "", "| metric | value | baseline | ratio | target | met? |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "–" if r.ratio is None else f"{r.ratio:.2f}×"
        met = "–" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(f"| {r.metric} | {r.value} | {r.baseline} | {ratio} | {r.target} | {met} |")
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def emit(title: str, rows: list[Row], notes: list[str] = ()) -> None:  # type: ignore[assignment]
    print(render_table(title, rows, notes), flush=True)
    record(title, rows)


def record(title: str, rows: list[Row]) -> None:
    """Rows as data, for `python -m bench --json FILE` (a table printed in another shape records its figures
    here too)."""
    if path := os.environ.get(JSON_ENV):
        # Appended, one line a row: `python -m bench --json FILE` runs each benchmark as its own process.
        with open(path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(row_record(title, r)) + "\n")


JSON_ENV = "LORA_WORKER_BENCH_JSONL"
_QUANTITY = re.compile(r"\s*([-+]?\d[\d,]*(?:\.\d+)?)\s*([^\s(;,]*)")


def quantity(text: str) -> tuple[float | None, str | None]:
    """The number a cell starts with and its unit ("1.14 ms" -> (1.14, "ms")), or (None, None)."""
    m = _QUANTITY.match(text)
    return (float(m.group(1).replace(",", "")), m.group(2) or None) if m else (None, None)


def row_record(title: str, r: Row) -> dict[str, Any]:
    value, unit = quantity(r.value)
    baseline, baseline_unit = quantity(r.baseline)
    return {"bench": title, "metric": r.metric, "value": value, "unit": unit, "value_text": r.value,
            "baseline": baseline, "baseline_unit": baseline_unit, "baseline_text": r.baseline,
            "ratio": r.ratio, "target": r.target, "met": r.met}


def arg_parser(doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(doc or "").split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check the bench runs, measure nothing")
    return parser


def python() -> str:
    return sys.executable

"""Benchmark 4, scale of history: start-up, listing and /metrics with 100,000 finished jobs, the full ledger
check start-up leaves to `lora-worker migrate`, and one job's ledger growth.

The history is one real job, dispatched through the app (so its row has a real argv and environment), copied
100,000 times with sqlite3 `executemany` into the migrated ledger: 70 % succeeded, 20 % failed (with a
failure class and an error holding a log tail), 10 % cancelled, three job_events each. (Their loss curves,
job_progress, are left out: they are keyed by job and touched by neither query; their size is the growth
figure below.) Each timing is a median of repeats, against the same operation on an empty ledger (and, for
the list, on a ledger of 250 jobs, 50 of them failed: the same response without the history).

Growth: the bytes the SQLite files (db + wal, after a TRUNCATE checkpoint) gain across one 3000-step run
(tier quality on device 1) of the fake trainer with the production progress interval (1 s).
"""
from __future__ import annotations

import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Row, arg_parser, bench_host, emit
from lora_worker import create_app
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import verify_integrity
from lora_worker.reconcile import reconcile
from tests.helpers import Host, set_modes, wait_for
from tests.helpers.service import settings_env

ERROR = ("The trainer ran out of GPU memory (CUDA out of memory).\n" + "steps:  45%|████▌     | 765/1700 "
         "[09:44<11:54,  1.31it/s, avr_loss=0.0871]\n" * 6)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of `fn` over `repeats` calls, after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def dispatch_one(host: Host) -> int:
    """One real job through the app, run to its end; its row is the template of the history."""
    set_modes(host.sd_scripts, step_s=0.0)
    app = create_app(host.settings)
    client = app.test_client()
    job_id = client.post("/train", json=host.payload(tier="fast")).get_json()["worker_job_id"]
    wait_for(lambda: client.get(f"/train/{job_id}").get_json()["status"] != "running", timeout=120, what="job end")
    app.extensions["lora_worker"].db.dispose()
    return job_id


def fill(path: Path, template_id: int, count: int) -> None:
    """`count` finished copies of the template job, with their events, in one transaction."""
    conn = sqlite3.connect(path)
    try:
        conn.row_factory = sqlite3.Row
        template = dict(conn.execute("SELECT * FROM jobs WHERE id = ?", (template_id,)).fetchone())
        del template["id"]
        columns = list(template)
        rows, events = [], []
        first = conn.execute("SELECT max(id) FROM jobs").fetchone()[0] + 1
        for i in range(count):
            status = ("succeeded",) * 7 + ("failed",) * 2 + ("cancelled",)
            row = dict(template, status=status[i % 10], output_name=f"lora_{i}", seed=i,
                       failure_class="cuda_oom" if status[i % 10] == "failed" else None,
                       error=ERROR if status[i % 10] == "failed" else None)
            rows.append(tuple(row[c] for c in columns))
            at = row["created_at"]
            events += [(first + i, at, None, "queued", "api", "accepted"),
                       (first + i, at, "queued", "running", "supervisor", "supervisor started"),
                       (first + i, at, "running", row["status"], "supervisor", "trainer finished")]
        conn.executemany(f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})", rows)
        conn.executemany("INSERT INTO job_events (job_id, at, from_status, to_status, actor, reason) "
                         "VALUES (?, ?, ?, ?, ?, ?)", events)
        conn.commit()
    finally:
        conn.close()


def file_bytes(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


class Ledger:
    """The operations measured, on one host's ledger."""

    def __init__(self, host: Host, repeats: int) -> None:
        self.host, self.repeats = host, repeats

    def reconcile_s(self) -> float:
        db = Database.open(self.host.settings.database_path)
        try:
            return timed(lambda: reconcile(db, self.host.settings), self.repeats)
        finally:
            db.dispose()

    def cli_reconcile_s(self) -> float:
        env = {**settings_env(self.host.settings), "PATH": "/usr/bin:/bin"}
        argv = [str(Path(sys.executable).parent / "lora-worker"), "reconcile"]
        return timed(lambda: subprocess.run(argv, env=env, check=True, capture_output=True), max(1, self.repeats // 4))

    def startup_s(self) -> float:
        def build() -> None:
            create_app(self.host.settings).extensions["lora_worker"].db.dispose()
        return timed(build, max(1, self.repeats // 4))

    def full_check_s(self) -> float:
        """The check that reads every page, which start-up leaves to `lora-worker migrate` and `doctor`."""
        return timed(lambda: verify_integrity(self.host.settings.database_path), max(1, self.repeats // 4))

    def metrics_s(self) -> float:
        return self.get_s("/metrics")

    def list_s(self) -> float:
        return self.get_s("/train?status=failed&limit=50")

    def get_s(self, url: str) -> float:
        """Median time of a GET through the Flask test client (no HTTP server in the measure)."""
        app = create_app(self.host.settings)
        client = app.test_client()
        try:
            def get() -> None:
                assert client.get(url).status_code == 200
            return timed(get, self.repeats * 5)
        finally:
            app.extensions["lora_worker"].db.dispose()


def growth(size: int) -> tuple[int, int, int, int]:
    """(bytes, progress rows the run recorded, events, rows filled in) one 3000-step job adds to the ledger.

    The fake trainer runs fast (a few ms a step), so the supervisor, which reads its output at most four
    times a second, records only the steps it sees. A real SDXL run takes ~1 s a step or more and gets a row
    for every step; the steps the fast run skipped are filled in with rows shaped like the recorded ones
    (same job, a loss, an ISO time), so the figure is that of a real run's loss curve.
    """
    with bench_host() as host:
        path = host.settings.database_path
        before = file_bytes(path)
        set_modes(host.sd_scripts, step_s=0.004 if size else 0.0)
        app = create_app(host.settings)
        client = app.test_client()
        job_id = client.post("/train", json=host.payload(tier="quality" if size else "fast")).get_json()[
            "worker_job_id"]
        wait_for(lambda: client.get(f"/train/{job_id}").get_json()["status"] in ("succeeded", "failed", "cancelled"),
                 timeout=600, what="job end")  # not just "not running": a new job is "queued" at first
        app.extensions["lora_worker"].db.dispose()
        conn = sqlite3.connect(path)
        total_steps, = conn.execute("SELECT total_steps FROM jobs WHERE id = ?", (job_id,)).fetchone()
        recorded = {step: (loss, at) for step, loss, at in
                    conn.execute("SELECT step, loss, at FROM job_progress WHERE job_id = ?", (job_id,))}
        sample_loss, sample_at = next(iter(recorded.values()), (0.1, "2026-11-30T00:00:00.000000+00:00"))
        missing = [(job_id, step, sample_loss, sample_at) for step in range(1, total_steps + 1)
                   if step not in recorded]
        with conn:
            conn.executemany("INSERT INTO job_progress (job_id, step, loss, at) VALUES (?, ?, ?, ?)", missing)
        events = conn.execute("SELECT count(*) FROM job_events").fetchone()[0]
        conn.close()
        return file_bytes(path) - before, len(recorded), events, len(missing)


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.repeats = 200, 1
    results: dict[str, dict[str, float]] = {}
    sizes: dict[str, int] = {}
    for name, count in (("empty", 0), ("page", 250), ("history", args.jobs)):  # page: 50 of them failed
        with bench_host() as host:
            if count:
                fill(host.settings.database_path, dispatch_one(host), count)
            ledger = Ledger(host, args.repeats)
            results[name] = {"reconcile": ledger.reconcile_s(), "cli": ledger.cli_reconcile_s(),
                             "startup": ledger.startup_s(), "full_check": ledger.full_check_s(),
                             "list": ledger.list_s(),
                             "metrics": ledger.metrics_s()}
            sizes[name] = file_bytes(host.settings.database_path)
    empty, page, history = results["empty"], results["page"], results["history"]
    n = f"{args.jobs:,}"
    rows = [
        Row(f"reconcile() with {n} jobs", f"{history['reconcile'] * 1e3:.2f} ms",
            f"{empty['reconcile'] * 1e3:.2f} ms (empty)", history["reconcile"] / empty["reconcile"], "≤ 2×",
            history["reconcile"] / empty["reconcile"] <= 2),
        Row("`lora-worker reconcile` (whole command)", f"{history['cli'] * 1e3:.0f} ms",
            f"{empty['cli'] * 1e3:.0f} ms (empty)", history["cli"] / empty["cli"], "≤ 2×",
            history["cli"] / empty["cli"] <= 2),
        Row("app start-up (bounded ledger check + reconcile)", f"{history['startup'] * 1e3:.1f} ms",
            f"{empty['startup'] * 1e3:.1f} ms (empty)", history["startup"] / empty["startup"], "≤ 2×",
            history["startup"] / empty["startup"] <= 2),
        Row("full ledger check (`lora-worker migrate`, `doctor`)", f"{history['full_check'] * 1e3:.0f} ms",
            f"{empty['full_check'] * 1e3:.1f} ms (empty)", history["full_check"] / empty["full_check"]),
        Row("GET /train?status=failed&limit=50", f"{history['list'] * 1e3:.2f} ms",
            f"{empty['list'] * 1e3:.2f} ms (empty)", history["list"] / empty["list"], "≤ 2×",
            history["list"] / empty["list"] <= 2),
        Row("… against one page of jobs (same response)", f"{history['list'] * 1e3:.2f} ms",
            f"{page['list'] * 1e3:.2f} ms (250 jobs, 50 failed)", history["list"] / page["list"], "≤ 2×",
            history["list"] / page["list"] <= 2),
        Row("GET /metrics", f"{history['metrics'] * 1e3:.2f} ms", f"{empty['metrics'] * 1e3:.2f} ms (empty)",
            history["metrics"] / empty["metrics"], "≤ 2×", history["metrics"] / empty["metrics"] <= 2),
        Row("ledger size", f"{sizes['history'] / 1e6:.1f} MB", f"{sizes['empty'] / 1e6:.2f} MB (empty)"),
    ]
    grown, points, events, filled = growth(0 if args.quick else 1)
    rows.append(Row("ledger growth for one 3000-step job" if not args.quick else "ledger growth for one job",
                    f"{grown:,} bytes", f"{points + filled} progress rows, {events} events"))
    emit("Scale of history", rows, [
        f"the fast fake run recorded {points} progress rows (the supervisor reads at most 4 times a second); "
        f"{filled} more were filled in for the steps it skipped, as a real run at ~1 s a step records them all",
        "a progress row is one (step, loss, time) of the loss curve"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark 3, dispatch and cancel latency, through gunicorn with the production settings.

Dispatch: wall-clock time from just before `POST /train` to the moment the fake trainer starts (it records
`time.time()` first thing in its main, `record` mode), against a bare `subprocess.Popen` of the same stored
argv and environment (the fake `accelerate` launching the fake trainer, same record mode) timed the same way.
So the ratio is what validation, admission, the ledger INSERT, the detached supervisor's start and its
`running` write add to starting the trainer itself.

Cancel: from just before `POST /train/<id>/cancel` to the moment no process of the job's group is alive
(polling /proc), for a trainer that dies on SIGTERM and one that ignores it (then the supervisor's grace
`cancel_grace_s` runs out and SIGKILL follows). Baseline: `killpg(SIGTERM)` of a bare group, timed the same.
"""
from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import Row, arg_parser, bench_host, emit, running_service
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.host import processes
from tests.helpers import Host, set_modes, wait_for
from tests.service import Service

GRACE_S = 2.0  # shorter than production's 20 s; the overshoot past it is what is measured


def recorded(path: Path) -> dict:
    return wait_for(lambda: path.exists() and json.loads(path.read_text()), timeout=60, interval=0.001,
                    what=f"trainer record {path}")


def group_gone_after(pgid: int, start: float) -> float:
    wait_for(lambda: not processes.group_members(pgid), timeout=120, interval=0.002, what=f"group {pgid} gone")
    return time.monotonic() - start


def dispatch_once(svc: Service, host: Host, n: int,
                  ignore_sigterm: bool) -> tuple[float, float, float, int]:
    """(dispatch latency, POST answered, cancel latency) of one job, and its id."""
    record = host.root / f"record-{n}.json"
    set_modes(host.sd_scripts, step_s=1.0, record=str(record), ignore_sigterm=ignore_sigterm)
    before = time.time()
    code, body, _ = svc.request("POST", "/train", host.payload(output_name=f"run{n}"))
    assert code == 202, body
    answered = time.time() - before
    rec = recorded(record)
    job_id = int(body["worker_job_id"])
    # The trainer starts at a fixed point of the supervisor's cancel-poll cycle; a random wait samples the
    # whole cycle, as a user's click would.
    time.sleep(random.Random(n).uniform(0.0, 1.0))
    start = time.monotonic()
    assert svc.request("POST", f"/train/{job_id}/cancel")[0] == 202
    cancel_s = group_gone_after(rec["pgid"], start)
    wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["status"] == "cancelled", timeout=60,
             what="cancelled")
    return rec["t"] - before, answered, cancel_s, job_id


def bare_once(host: Host, argv: list[str], env: dict[str, str], n: int) -> tuple[float, float]:
    """(start latency, SIGTERM-to-gone) of the same command started with Popen."""
    record = host.root / f"bare-{n}.json"
    set_modes(host.sd_scripts, step_s=1.0, record=str(record))
    before = time.time()
    proc = subprocess.Popen(argv, cwd=host.sd_scripts, env=env, stdin=subprocess.DEVNULL,  # noqa: S603
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rec = recorded(record)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()  # the launcher; the trainer is its child and dies with the group
    gone = group_gone_after(proc.pid, start)
    return rec["t"] - before, gone


def run(svc: Service, host: Host, runs: int, ignoring_runs: int) -> tuple[list[Row], list[str]]:
    dispatch, answered, cancel, bare_start, bare_cancel = [], [], [], [], []
    db = Database.open(host.settings.database_path)
    try:
        for n in range(runs):
            d, a, c, job_id = dispatch_once(svc, host, n, ignore_sigterm=False)
            dispatch.append(d)
            answered.append(a)
            cancel.append(c)
            job = repo.get_job(db, job_id)
            s, k = bare_once(host, job.argv, job.env, n)
            bare_start.append(s)
            bare_cancel.append(k)
        ignoring = [dispatch_once(svc, host, runs + n, ignore_sigterm=True)[2] for n in range(ignoring_runs)]
    finally:
        db.dispose()
    med, base = statistics.median(dispatch), statistics.median(bare_start)
    rows = [
        Row(f"dispatch → trainer started, median of {runs}", f"{med * 1e3:.0f} ms",
            f"{base * 1e3:.0f} ms (bare Popen)", med / base),
        Row("dispatch → trainer started, max", f"{max(dispatch) * 1e3:.0f} ms", f"{max(bare_start) * 1e3:.0f} ms",
            max(dispatch) / max(bare_start)),
        Row("… of which POST /train answered (median)", f"{statistics.median(answered) * 1e3:.0f} ms"),
        Row(f"cancel → group gone (honours SIGTERM), median of {runs}", f"{statistics.median(cancel) * 1e3:.0f} ms",
            f"{statistics.median(bare_cancel) * 1e3:.0f} ms (bare killpg)",
            statistics.median(cancel) / statistics.median(bare_cancel)),
        Row("cancel → group gone (honours SIGTERM), max", f"{max(cancel) * 1e3:.0f} ms",
            f"{max(bare_cancel) * 1e3:.0f} ms", max(cancel) / max(bare_cancel)),
        Row(f"cancel → group gone (ignores SIGTERM), median of {ignoring_runs}",
            f"{statistics.median(ignoring) * 1e3:.0f} ms", f"grace {GRACE_S * 1e3:.0f} ms",
            statistics.median(ignoring) / GRACE_S),
        Row("… overshoot past the grace, median / max", f"{(statistics.median(ignoring) - GRACE_S) * 1e3:.0f} ms / "
            f"{(max(ignoring) - GRACE_S) * 1e3:.0f} ms"),
    ]
    notes = ["the supervisor notices a cancel by polling the ledger every 0.5 s (run/requests.py CANCEL_POLL_S), "
             "so up to 0.5 s of each cancel is that poll",
             f"cancel_grace_s = {GRACE_S:g} s here (production: 20 s); the overshoot does not depend on it"]
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ignoring-runs", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.ignoring_runs = 1, 1
    with bench_host(cancel_grace_s=GRACE_S) as host:
        with running_service(host) as svc:
            rows, notes = run(svc, host, args.runs, args.ignoring_runs)
    emit("Dispatch and cancel latency", rows, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

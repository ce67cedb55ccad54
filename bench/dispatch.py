"""Benchmark 3, dispatch and cancel latency, through gunicorn with the production settings.

Dispatch: time from just before `POST /train` to two end points of the fake trainer's start: its execve (the
kernel's own record, `sched:sched_process_exec` traced by perf on CLOCK_MONOTONIC, where perf may trace; else
the trainer's start time in /proc, in 10 ms ticks) and its main (it records `time.time()` first thing there,
`record` mode). Baseline: a bare `subprocess.Popen` of the same stored argv and environment (the fake
`accelerate` launching the fake trainer, same record mode) timed the same way. So the ratio is what
validation, admission, the ledger INSERT, the detached supervisor's start and its `running` write add to
starting the trainer itself.

Cancel: from just before `POST /train/<id>/cancel` to the moment no process of the job's group is alive
(polling /proc), for a trainer that dies on SIGTERM and one that ignores it (then the supervisor's grace
`cancel_grace_s` runs out and SIGKILL follows). Baseline: `killpg(SIGTERM)` of a bare group, timed the same.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import CLOCK_TICKS, Row, arg_parser, bench_host, emit, running_service
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.host import processes
from tests.helpers import Host, set_modes, wait_for
from tests.helpers.service import Service

GRACE_S = 2.0  # shorter than production's 20 s; the overshoot past it is what is measured


# Targets of issue 18 (docs/benchmarks.md section 3).
POST_TARGET_S = 0.060
EXEC_TARGET_S = 0.100
EXEC_RATIO_TARGET = 3.0
CANCEL_TARGET_S = 0.100


class ExecTrace:
    """When each process was exec'd, as the kernel recorded it: `perf record` of sched:sched_process_exec on
    CLOCK_MONOTONIC for the whole benchmark, read once it is stopped. Where perf is missing or may not trace
    (not root, perf_event_paranoid), `exec_at` falls back to /proc's start time (the fork, in clock ticks:
    10 ms resolution), read while the trainer runs."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="lora-bench-perf-")
        self._data = Path(self._dir.name) / "exec.data"
        self._perf: subprocess.Popen[bytes] | None = None
        self._execs: dict[int, float] = {}
        self._ticks: dict[int, float] = {}
        self.source = "/proc start time, 10 ms ticks"

    def __enter__(self) -> ExecTrace:
        if shutil.which("perf"):
            self._perf = subprocess.Popen(  # noqa: S603, S607
                ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-e", "sched:sched_process_exec", "-a",
                 "-o", str(self._data)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # perf opens its events; one that may not trace has exited by now
            if self._perf.poll() is not None:
                self._perf = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._perf is not None:
            self._perf.send_signal(signal.SIGINT)
            self._perf.wait(timeout=60)
            script = ["perf", "script", "-i", str(self._data), "--ns", "-F", "time,trace"]
            out = subprocess.run(script, capture_output=True, text=True, check=False).stdout  # noqa: S603
            for line in out.splitlines():
                m = re.match(r"\s*(\d+\.\d+):.*\bpid=(\d+)", line)
                if m:
                    self._execs[int(m.group(2))] = float(m.group(1))  # the last exec of a pid wins
            if self._execs:
                self.source = "perf, sched:sched_process_exec"
        self._dir.cleanup()

    def note(self, pid: int) -> None:
        """Read the fallback while `pid` is alive."""
        if (ticks := processes.start_ticks(pid)) is not None:
            self._ticks[pid] = ticks / CLOCK_TICKS

    def exec_at(self, pid: int, before_mono: float, before_boot: float) -> float | None:
        """Seconds from `before` to the execve of `pid`."""
        if self._execs:
            at = self._execs.get(pid)
            return None if at is None else at - before_mono
        at = self._ticks.get(pid)
        return None if at is None else at - before_boot


@dataclass
class Start:
    """One start of the trainer: the clocks just before it was asked for, and its record."""

    before_wall: float
    before_mono: float
    before_boot: float
    pid: int
    main_t: float

    def main_after(self) -> float:
        return self.main_t - self.before_wall

    def exec_after(self, trace: ExecTrace) -> float | None:
        return trace.exec_at(self.pid, self.before_mono, self.before_boot)


def clocks() -> tuple[float, float, float]:
    return time.time(), time.monotonic(), time.clock_gettime(time.CLOCK_BOOTTIME)


def recorded(path: Path) -> dict:
    return wait_for(lambda: path.exists() and json.loads(path.read_text()), timeout=60, interval=0.001,
                    what=f"trainer record {path}")


def group_gone_after(pgid: int, start: float) -> float:
    wait_for(lambda: not processes.group_members(pgid), timeout=120, interval=0.002, what=f"group {pgid} gone")
    return time.monotonic() - start


def dispatch_once(svc: Service, host: Host, trace: ExecTrace, n: int,
                  ignore_sigterm: bool) -> tuple[Start, float, float, int]:
    """(the trainer's start, POST answered, cancel latency) of one job, and its id."""
    record = host.root / f"record-{n}.json"
    set_modes(host.sd_scripts, step_s=1.0, record=str(record), ignore_sigterm=ignore_sigterm)
    before = clocks()
    code, body, _ = svc.request("POST", "/train", host.payload(output_name=f"run{n}"))
    assert code == 202, body
    answered = time.time() - before[0]
    rec = recorded(record)
    trace.note(rec["pid"])
    job_id = int(body["worker_job_id"])
    # The trainer starts at a fixed point of the supervisor's cancel-poll cycle; a random wait samples the
    # whole cycle, as a user's click would.
    time.sleep(random.Random(n).uniform(0.0, 1.0))
    start = time.monotonic()
    assert svc.request("POST", f"/train/{job_id}/cancel")[0] == 202
    cancel_s = group_gone_after(rec["pgid"], start)
    wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["status"] == "cancelled", timeout=60,
             what="cancelled")
    return Start(*before, rec["pid"], rec["t"]), answered, cancel_s, job_id


def bare_once(host: Host, trace: ExecTrace, argv: list[str], env: dict[str, str], n: int) -> tuple[Start, float]:
    """(the trainer's start, SIGTERM-to-gone) of the same command started with Popen."""
    record = host.root / f"bare-{n}.json"
    set_modes(host.sd_scripts, step_s=1.0, record=str(record))
    before = clocks()
    proc = subprocess.Popen(argv, cwd=host.sd_scripts, env=env, stdin=subprocess.DEVNULL,  # noqa: S603
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rec = recorded(record)
    trace.note(rec["pid"])
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()  # the launcher; the trainer is its child and dies with the group
    gone = group_gone_after(proc.pid, start)
    return Start(*before, rec["pid"], rec["t"]), gone


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def run(svc: Service, host: Host, runs: int, ignoring_runs: int) -> tuple[list[Row], list[str]]:
    starts, answered, cancel, bare_starts, bare_cancel = [], [], [], [], []
    db = Database.open(host.settings.database_path)
    trace = ExecTrace()
    try:
        with trace:
            for n in range(runs):
                s, a, c, job_id = dispatch_once(svc, host, trace, n, ignore_sigterm=False)
                starts.append(s)
                answered.append(a)
                cancel.append(c)
                job = repo.get_job(db, job_id)
                b, k = bare_once(host, trace, job.argv, job.env, n)
                bare_starts.append(b)
                bare_cancel.append(k)
            ignoring = [dispatch_once(svc, host, trace, runs + n, ignore_sigterm=True)[2]
                        for n in range(ignoring_runs)]
    finally:
        db.dispose()
    post = statistics.median(answered)
    main_s, bare_main = [s.main_after() for s in starts], [b.main_after() for b in bare_starts]
    execs = [e for s in starts if (e := s.exec_after(trace)) is not None]
    bare_execs = [e for b in bare_starts if (e := b.exec_after(trace)) is not None]
    med_c, base_c = statistics.median(cancel), statistics.median(bare_cancel)
    rows = [Row(f"POST /train answered, median of {runs}", ms(post), target=f"≤ {ms(POST_TARGET_S)}",
                met=post <= POST_TARGET_S)]
    if execs and bare_execs:
        med_e, base_e = statistics.median(execs), statistics.median(bare_execs)
        rows += [
            Row(f"POST /train → trainer execve, median of {len(execs)}", ms(med_e), target=f"< {ms(EXEC_TARGET_S)}",
                met=med_e < EXEC_TARGET_S),
            Row("POST /train → trainer execve, ratio to a bare Popen's", ms(med_e), f"{ms(base_e)} (bare Popen)",
                med_e / base_e, target=f"≤ {EXEC_RATIO_TARGET:g}×", met=med_e / base_e <= EXEC_RATIO_TARGET),
            Row("POST /train → trainer execve, max", ms(max(execs)), ms(max(bare_execs)),
                max(execs) / max(bare_execs)),
        ]
    else:
        rows.append(Row("POST /train → trainer execve", "not measured (no exec time was readable)",
                        target=f"< {ms(EXEC_TARGET_S)}"))
    med_m, base_m = statistics.median(main_s), statistics.median(bare_main)
    rows += [
        Row(f"POST /train → trainer main, median of {runs}", ms(med_m), f"{ms(base_m)} (bare Popen)", med_m / base_m),
        Row("POST /train → trainer main, max", ms(max(main_s)), ms(max(bare_main)), max(main_s) / max(bare_main)),
        Row(f"cancel → group gone (honours SIGTERM), median of {runs}", ms(med_c), f"{ms(base_c)} (bare killpg)",
            med_c / base_c, target=f"< {ms(CANCEL_TARGET_S)}", met=med_c < CANCEL_TARGET_S),
        Row("cancel → group gone (honours SIGTERM), max", ms(max(cancel)), ms(max(bare_cancel)),
            max(cancel) / max(bare_cancel)),
        Row(f"cancel → group gone (ignores SIGTERM), median of {ignoring_runs}",
            ms(statistics.median(ignoring)), f"grace {ms(GRACE_S)}", statistics.median(ignoring) / GRACE_S),
        Row("… overshoot past the grace, median / max", f"{ms(statistics.median(ignoring) - GRACE_S)} / "
            f"{ms(max(ignoring) - GRACE_S)}"),
    ]
    notes = [f"execve times from {trace.source}; main from the trainer's own `time.time()` first thing in main",
             "the web's cancel wakes the supervisor (a signal to its recorded, identity-checked pid); its 0.5 s "
             "ledger poll (run/requests.py CANCEL_POLL_S) is the fallback",
             f"cancel_grace_s = {GRACE_S:g} s here (production: 20 s); the overshoot does not depend on it"]
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ignoring-runs", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.ignoring_runs = 1, 1
    with bench_host(cancel_grace_s=GRACE_S) as host, running_service(host) as svc:
        rows, notes = run(svc, host, args.runs, args.ignoring_runs)
    emit("Dispatch and cancel latency", rows, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

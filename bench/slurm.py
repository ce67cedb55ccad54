"""Benchmark 7, the Slurm backend: the two figures issue #17's closing note asks for.

Poller cost: one `Poller.cycle()` after another over N active jobs (1 and 8), each job's log growing by what a
trainer writes between two polls at the default `slurm_poll_interval_s` (tqdm redraws, 10 a second, with the
step advancing), so each cycle reads, parses and writes progress as in a real run. CPU is taken around the
cycle alone (`os.times`): the poller's own (user + system) and that of the scheduler commands it ran (its
waited children). In that steady state a cycle runs one `squeue` for all the jobs (sacct only for jobs squeue
shows ended). The cycles run on stand-in commands, /bin/sh scripts that answer every job RUNNING, so the
poller's side is the same whatever cluster is there. Where the single-node cluster of tests/cluster/cluster.py
can start (root, the Slurm and MariaDB packages), the real `squeue` over N real jobs (held, so pending) is
timed too, with what it costs slurmctld to answer, and those figures make the per-job and per-core rows.

POST /train → trainer started: from just before `POST /train` (Flask's test client: the routes gunicorn
serves) to the `t` the fake trainer records first thing in its main (`record` mode), on the same machine and
clock. Local: today's detached supervisor. Slurm: the real single-node cluster, sbatch in the POST, slurmctld
scheduling it, slurmd starting the batch script; once with the poller already running (a worker's steady
state) and once with that dispatch starting it. Each run is a fresh worker, stopped before the next.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bench.common import CLOCK_TICKS, Row, arg_parser, bench_host, emit, insert_job
from lora_worker.config import Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from tests.helpers import Host, make_host, set_modes, wait_for

DEFAULT_POLL_S: float = next(f.default for f in fields(Settings) if f.name == "slurm_poll_interval_s")  # type: ignore[assignment]
REDRAWS_PER_S = 10  # tqdm's default refresh on a steadily stepping bar
ACTIVE = (1, 8)
TOTAL_STEPS = 3000

# The stand-ins: squeue answers every job it is asked about RUNNING, in the format the worker asks for.
STAND_IN_SQUEUE = ('#!/bin/sh\nfor a; do case "$a" in --jobs=*) ids="${a#--jobs=}";; esac; done\n'
                   'echo "$ids" | tr , "\\n" | sed "s/$/|RUNNING|None/"\n')
STAND_IN_SACCT = "#!/bin/sh\nexit 0\n"


def children_cpu() -> float:
    """User + system seconds of every waited child so far, in microseconds (os.times rounds to 10 ms ticks)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- the poller ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cost:
    """Mean CPU seconds per cycle."""

    poller: float
    commands: float
    wall: float


def steps_bar(step: int, loss: float = 0.1) -> str:
    """One tqdm redraw of sd-scripts' `steps` bar, as it reaches the log (the \\r before it)."""
    pct = 100 * step // TOTAL_STEPS
    return f"\rsteps: {pct:3d}%|#####     | {step}/{TOTAL_STEPS} [00:10<00:12,  2.00it/s, avr_loss={loss}]"


def install_stand_ins(bin_dir: Path) -> Path:
    bin_dir.mkdir(parents=True)
    for name, text in (("squeue", STAND_IN_SQUEUE), ("sacct", STAND_IN_SACCT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def poller_cost(active: int, cycles: int) -> Cost:
    from lora_worker.slurm.poller import Poller
    from lora_worker.slurm.sbatch import log_path
    from lora_worker.slurm.scheduler import Scheduler

    with bench_host() as host:
        bin_dir = install_stand_ins(host.root / "slurm-bin")
        settings = host.settings.with_overrides(backend="slurm", slurm_bin_dir=bin_dir)
        settings.slurm_logs.mkdir(parents=True, exist_ok=True)
        db = Database.open(settings.database_path)
        poller = Poller(settings, db, Scheduler(bin_dir), time.monotonic)
        try:
            jobs = []
            for k in range(active):
                job_id = insert_job(db, ["true"], settings.train_root, backend="slurm", slot=f"slurm-{k}",
                                    total_steps=TOTAL_STEPS)
                repo.record_slurm_job(db, job_id, str(5000 + k))
                jobs.append(job_id)
            poller.cycle()  # the first sight of each job: attach, `running`; not the steady state measured
            redraws = round(DEFAULT_POLL_S * REDRAWS_PER_S)
            own = kids = wall = 0.0
            for c in range(cycles):
                for job_id in jobs:  # what each trainer wrote since the last poll
                    with log_path(settings, job_id).open("a") as fh:
                        fh.write("".join(steps_bar(c * redraws + i + 1) for i in range(redraws)))
                k0, p0, w0 = children_cpu(), time.process_time(), time.perf_counter()
                poller.cycle()
                k1, p1, w1 = children_cpu(), time.process_time(), time.perf_counter()
                own += p1 - p0
                kids += k1 - k0
                wall += w1 - w0
            steps = {repo.get_job(db, j).step for j in jobs}
            assert steps == {cycles * redraws}, f"the poller did not follow the logs: steps {steps}"
        finally:
            poller.close()
            db.dispose()
    return Cost(own / cycles, kids / cycles, wall / cycles)


# -- the real cluster ---------------------------------------------------------------------------------------

def cluster_unavailable() -> str | None:
    from tests.cluster.cluster import missing_programs

    missing = missing_programs()
    if missing:
        return "no single-node Slurm here (missing " + ", ".join(missing) + ")"
    if os.geteuid() != 0:
        return "the single-node Slurm runs its daemons as root; run the benchmark as root"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no cgroup hierarchy at /sys/fs/cgroup (proctrack/cgroup)"
    return None


def process_cpu(pid: int) -> float:
    """User + system seconds of `pid`, every thread of it, ended ones too (slurmctld answers each RPC on a
    thread of its own): /proc/<pid>/stat, in 10 ms ticks, so read over many calls."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    parts = stat[stat.rfind(")") + 2:].split()
    return (int(parts[11]) + int(parts[12])) / CLOCK_TICKS


@dataclass(frozen=True)
class SqueueCost:
    command: float  # squeue's own CPU per call
    controller: float  # slurmctld's CPU per call, idle drift included


def real_squeue_cost(cluster: Any, active: int, calls: int) -> SqueueCost:
    """`Scheduler.queue` (the poller's one squeue per cycle) over `active` held jobs of the real cluster."""
    from lora_worker.slurm.scheduler import Scheduler

    ids = [cluster.run("sbatch", "--parsable", "--hold", "--partition=gpu", "--mem=10", "--output=/dev/null",
                       "--wrap", "sleep 600").stdout.strip().split(";")[0] for _ in range(active)]
    try:
        scheduler = Scheduler(cluster.bin_dir)
        assert len(scheduler.queue(ids)) == active
        ctld = cluster.pids["slurmctld"]
        k0, c0 = children_cpu(), process_cpu(ctld)
        for _ in range(calls):
            scheduler.queue(ids)
        k1, c1 = children_cpu(), process_cpu(ctld)
    finally:
        cluster.run("scancel", *ids, check=False)
    return SqueueCost((k1 - k0) / calls, (c1 - c0) / calls)


# -- POST /train → trainer started --------------------------------------------------------------------------

@dataclass(frozen=True)
class Start:
    answered: float  # POST /train answered
    started: float  # the trainer's main


def dispatch(client: Any, host: Host, stop: Callable[[int], None]) -> Start:
    record = host.root / "record.json"
    set_modes(host.sd_scripts, step_s=1.0, record=str(record))
    posted = time.time()
    answer = client.post("/train", json=host.payload())
    accepted = time.time()
    assert answer.status_code == 202, answer.get_json()
    wait_for(lambda: record.exists() and record.read_text(), timeout=120, interval=0.005, what="the trainer's start")
    started = json.loads(record.read_text())["t"]
    stop(answer.get_json()["worker_job_id"])
    return Start(accepted - posted, started - posted)


def local_start(root: Path) -> Start:
    from lora_worker import create_app
    from lora_worker.ledger.migrate import upgrade

    host = make_host(root, progress_interval_s=1.0, cancel_grace_s=20.0, launch_grace_s=30.0)
    upgrade(host.settings.database_path)
    app = create_app(host.settings)
    client = app.test_client()

    def stop(job_id: int) -> None:
        assert client.post(f"/train/{job_id}/cancel").status_code == 202
        wait_for(lambda: client.get(f"/train/{job_id}").get_json()["status"] == "cancelled", timeout=60,
                 what="the local job cancelled")
    try:
        return dispatch(client, host, stop)
    finally:
        app.extensions["lora_worker"].db.dispose()


def slurm_start(cluster: Any, root: Path, poller_first: bool) -> Start:
    from lora_worker.slurm.process import ensure_poller
    from tests.cluster.worker import start_worker

    worker = start_worker(cluster, root, slurm_poll_interval_s=DEFAULT_POLL_S)
    try:
        if poller_first:
            ensure_poller(worker.settings)
        # close() scancels what is still there and waits until none of its processes is left on the node
        return dispatch(worker.client, worker.host, lambda job_id: worker.submitted.append(job_id))
    finally:
        worker.close()


# -- the table ----------------------------------------------------------------------------------------------

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def spread(values: list[float]) -> str:
    return f"{ms(statistics.median(values))} ({ms(min(values))}–{ms(max(values))})"


def poller_rows(costs: dict[int, Cost], real: dict[int, SqueueCost] | None, calls: int) -> list[Row]:
    one, many = costs[ACTIVE[0]], costs[ACTIVE[-1]]
    rows = [
        Row(f"poller CPU per cycle, {n} active job{'s' * (n > 1)} (the poller itself)", ms(costs[n].poller),
            *((ms(one.poller), costs[n].poller / one.poller) if n != ACTIVE[0] and one.poller else ()))
        for n in ACTIVE
    ]
    rows += [Row(f"… the scheduler commands it ran, {n} active job{'s' * (n > 1)} (stand-in /bin/sh squeue)",
                 ms(costs[n].commands)) for n in ACTIVE]
    if real is not None:
        rows += [Row(f"… the real squeue over {n} job{'s' * (n > 1)}, per call (mean of {calls})",
                     ms(real[n].command)) for n in ACTIVE]
        rows += [Row(f"… slurmctld answering it, {n} job{'s' * (n > 1)}, per call", ms(real[n].controller))
                 for n in ACTIVE]

    def per_cycle(n: int) -> float:
        return costs[n].poller + (real[n].command if real is not None else costs[n].commands)
    which = "real squeue" if real is not None else "stand-in squeue"
    rows += [Row(f"CPU per active job per cycle, {n} active job{'s' * (n > 1)} (poller + {which})",
                 ms(per_cycle(n) / n)) for n in ACTIVE]
    rows += [Row(f"share of one core at slurm_poll_interval_s = {DEFAULT_POLL_S:g} s, {n} active "
                 f"job{'s' * (n > 1)} (poller + {which})", f"{per_cycle(n) / DEFAULT_POLL_S * 100:.3f} %")
             for n in ACTIVE]
    rows.append(Row(f"poller wall time per cycle, {ACTIVE[-1]} active jobs (stand-ins)", ms(many.wall)))
    return rows


def start_rows(local: list[Start], slurm: dict[bool, list[Start]] | None, reason: str | None,
               runs: int) -> list[Row]:
    started = [s.started for s in local]
    rows = [Row(f"POST /train → trainer started, local, median of {runs} (min–max)", spread(started))]
    if slurm is None:
        rows += [Row("POST /train → trainer started, Slurm (poller running)", f"not measured: {reason}"),
                 Row("POST /train → trainer started, Slurm (first dispatch starts the poller)",
                     f"not measured: {reason}")]
    else:
        base = statistics.median(started)
        for first, label in ((True, "poller running"), (False, "first dispatch starts the poller")):
            values = [s.started for s in slurm[first]]
            rows.append(Row(f"POST /train → trainer started, Slurm ({label}), median of {runs} (min–max)",
                            spread(values), f"{ms(base)} (local)", statistics.median(values) / base))
    answered = [s.answered for s in local]
    rows.append(Row(f"… of which POST /train answered, local, median of {runs}", ms(statistics.median(answered))))
    if slurm is not None:
        answered = [s.answered for s in slurm[True]]
        rows.append(Row(f"… of which POST /train answered (sbatch in it), Slurm, median of {runs}",
                        ms(statistics.median(answered))))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--cycles", type=int, default=50, help="poller cycles measured per size")
    parser.add_argument("--runs", type=int, default=10, help="dispatches per backend")
    parser.add_argument("--no-cluster", action="store_true", help="do not start the single-node Slurm")
    args = parser.parse_args(argv)
    if args.quick:
        args.cycles, args.runs = 3, 1
    costs = {n: poller_cost(n, args.cycles) for n in ACTIVE}
    reason = "--no-cluster" if args.no_cluster else cluster_unavailable()
    real: dict[int, SqueueCost] | None = None
    slurm: dict[bool, list[Start]] | None = None
    local: list[Start] = []
    base = Path(tempfile.mkdtemp(prefix="lora-bench-slurm-", dir="/tmp"))
    try:
        if reason is None:
            from tests.cluster.cluster import Cluster

            base.chmod(0o755)  # munged wants every directory above its socket open to all
            cluster = Cluster(base / "cluster").start()
            os.environ["SLURM_CONF"] = str(cluster.conf)  # for every client the worker and its poller run
            try:
                real = {n: real_squeue_cost(cluster, n, args.cycles) for n in ACTIVE}
                slurm = {True: [], False: []}
                for i in range(args.runs):  # interleaved, so drift on a shared box falls on all three alike
                    local.append(local_start(base / f"local-{i}"))
                    for first in (True, False):
                        slurm[first].append(slurm_start(cluster, base / f"slurm-{first:d}-{i}", first))
            finally:
                cluster.stop()
                if stray := cluster.leftovers():
                    print(f"the single-node Slurm left processes behind: {stray}", file=sys.stderr)
        else:
            local = [local_start(base / f"local-{i}") for i in range(args.runs)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = poller_rows(costs, real, args.cycles) + start_rows(local, slurm, reason, args.runs)
    notes = [f"each cycle follows {round(DEFAULT_POLL_S * REDRAWS_PER_S)} tqdm redraws per job: "
             f"{DEFAULT_POLL_S:g} s of a trainer's output at {REDRAWS_PER_S} redraws a second",
             "the poller's CPU includes its ledger reads and progress writes (SQLite, this disk)",
             "slurmctld's per-call CPU is in 10 ms ticks over all the calls, its idle work included; it is spent on "
             "the controller, not the worker host, so the per-job and per-core rows leave it out",
             "Slurm's start includes slurmctld scheduling the job (sched on submit) and slurmd starting its batch "
             "script on the one node; a real cluster adds its queue and the hop to another host"]
    emit("Slurm: poller cost and POST /train → trainer started", rows, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

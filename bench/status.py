"""Benchmark 2, status under load: `GET /train/<id>` of a running job against `GET /healthz`, through gunicorn.

gunicorn runs exactly as deployed (systemd/gunicorn.conf.py: one gthread worker, 8 threads, access log on),
configured by LORA_WORKER_* variables (tests/service.py). The job is real: the fake trainer at one step a
second, so its supervisor writes the row once a second (two redraws a step) while we poll. The load
generator is wrk (Debian package `wrk`), with keep-alive connections, each route for the same duration at
1, 8 and 32 connections, the two routes alternating so drift on a noisy machine hits both alike.
"""
from __future__ import annotations

import re
import shutil
import subprocess

from bench.common import Row, arg_parser, bench_host, emit, peak_rss_mib, running_service
from tests.helpers import Host, set_modes, wait_for
from tests.service import Service

UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def wrk(url: str, connections: int, seconds: float) -> dict[str, float]:
    """Requests per second and p50/p99 latency (ms) from one wrk run."""
    out = subprocess.run(["wrk", "-t", str(min(connections, 2)), "-c", str(connections), "-d", f"{seconds:g}s",
                          "--latency", url], check=True, capture_output=True, text=True).stdout
    result = {"rps": float(re.search(r"Requests/sec:\s*([\d.]+)", out)[1])}  # type: ignore[index]
    for q in ("50", "99"):
        m = re.search(rf"^\s*{q}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        result[f"p{q}"] = float(m[1]) * UNITS[m[2]] if m else float("nan")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
    result["errors"] = float(non_2xx[1]) if non_2xx else 0.0
    return result


def start_job(svc: Service, host: Host) -> int:
    set_modes(host.sd_scripts, step_s=1.0)
    code, body, _ = svc.request("POST", "/train", host.payload(tier="quality", device_index=1))
    assert code == 202, body
    job_id = int(body["worker_job_id"])
    wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["step"] > 0, timeout=60, what="training")
    return job_id


def measure(svc: Service, job_id: int, levels: list[int], seconds: float) -> tuple[list[Row], list[str]]:
    rows, notes = [], []
    for c in levels:
        health = wrk(svc.url + "/healthz", c, seconds)
        status = wrk(svc.url + f"/train/{job_id}", c, seconds)
        ratio = status["rps"] / health["rps"]
        rows += [
            Row(f"{c} poller(s): throughput", f"{status['rps']:.0f} req/s", f"{health['rps']:.0f} req/s (/healthz)",
                ratio, "≥ 0.7×", ratio >= 0.7),
            Row(f"{c} poller(s): p50 latency", f"{status['p50']:.2f} ms", f"{health['p50']:.2f} ms",
                status["p50"] / health["p50"]),
            Row(f"{c} poller(s): p99 latency", f"{status['p99']:.2f} ms", f"{health['p99']:.2f} ms",
                status["p99"] / health["p99"]),
        ]
        if status["errors"] or health["errors"]:
            notes.append(f"{c} pollers: non-2xx answers: status {status['errors']:.0f}, "
                         f"healthz {health['errors']:.0f}")
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="wrk duration per route and level")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench/status.py needs wrk: apt-get install -y wrk")
        return 1
    levels, seconds = ([1, 8, 32], args.seconds) if not args.quick else ([1, 8], 1.0)
    with bench_host() as host:
        with running_service(host) as svc:
            job_id = start_job(svc, host)
            rows, notes = measure(svc, job_id, levels, seconds)
            worker = svc.workers()[0]
            notes.append(f"gunicorn worker peak RSS after the load: {peak_rss_mib(worker):.1f} MiB")
            step = svc.request("GET", f"/train/{job_id}")[1]["step"]
            notes.append(f"the job was at step {step} when the load ended (its row is written once a second)")
            svc.request("POST", f"/train/{job_id}/cancel")
            wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["status"] == "cancelled", timeout=60,
                     what="cancelled")
    emit("Status under load (gunicorn, production settings)", rows, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

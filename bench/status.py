"""Benchmark 2, status under load: `GET /train/<id>` of a running job against `GET /healthz`, through gunicorn.

gunicorn runs exactly as deployed (systemd/gunicorn.conf.py: one gthread worker, 8 threads, access log on),
configured by LORA_WORKER_* variables (tests/helpers/service.py). The job is real: the fake trainer at one step a
second, so its supervisor writes the row once a second (two redraws a step) while we poll. The load
generator is wrk (Debian package `wrk`), with keep-alive connections, each route for the same duration at
1, 8 and 32 connections, the two routes alternating so drift on a noisy machine hits both alike (skipped,
and said so, where wrk is not installed).

Long pollers (Python threads, no wrk needed): 256 clients long-polling the job as docs/jobs.md says, honouring
`Retry-After`, and how much they delay another client's `GET /train/<id>` (its latency percentiles with them
against without them, over a window longer than the longest Retry-After).
"""
from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import threading
import time
from urllib.parse import urlsplit

from bench.common import Row, arg_parser, bench_host, emit, peak_rss_mib, running_service
from tests.helpers import Host, set_modes, wait_for
from tests.helpers.service import Service

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


class Pollers:
    """`count` clients long-polling one job as docs/jobs.md says: `?since=<version>&wait=<wait>`, and, when an
    answer carries `Retry-After` (no long-poll slot was free), waiting that long before the next poll. Each
    request on its own connection, as a client that sleeps for seconds between polls would open one."""

    def __init__(self, svc: Service, job_id: int, count: int, wait_s: float) -> None:
        self.address, self.job_id, self.wait_s = urlsplit(svc.url).netloc, job_id, wait_s
        self.stopping = threading.Event()
        self.requests = 0
        self.retry_afters: list[int] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._poll, daemon=True) for _ in range(count)]

    def start(self) -> Pollers:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopping.set()  # the threads are daemons: one inside a 25 s wait is left to end with the service

    def count(self) -> int:
        with self._lock:
            return self.requests

    def _poll(self) -> None:
        version = 0
        while not self.stopping.is_set():
            try:
                status, body, retry_after = get(self.address, f"/train/{self.job_id}?since={version}"
                                                f"&wait={self.wait_s:g}", timeout=self.wait_s + 30)
            except OSError:
                if self.stopping.wait(0.1):
                    return
                continue
            with self._lock:
                self.requests += 1
                if retry_after is not None:
                    self.retry_afters.append(retry_after)
            version = json.loads(body)["version"] if status == 200 else version
            if retry_after is not None:
                self.stopping.wait(retry_after)


def get(address: str, path: str, timeout: float = 30.0) -> tuple[int, bytes, int | None]:
    """(status, body, Retry-After in seconds or None) of one GET on a new connection."""
    conn = http.client.HTTPConnection(address, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        retry_after = resp.getheader("Retry-After")
        return resp.status, body, int(retry_after) if retry_after else None
    finally:
        conn.close()


def latencies_ms(svc: Service, path: str, seconds: float, interval_s: float = 0.05) -> list[float]:
    """Another client: one GET every `interval_s` for `seconds`, each timed from connect to the last byte."""
    address, out = urlsplit(svc.url).netloc, []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        status, _, _ = get(address, path)
        out.append((time.perf_counter() - started) * 1e3)
        assert status == 200, status
        time.sleep(interval_s)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def pollers_delay(svc: Service, job_id: int, count: int, settle_s: float, seconds: float,
                  wait_s: float) -> tuple[list[Row], list[str]]:
    """How much `count` long pollers delay another client's GET /train/<id>: its latency with them against
    without them. The window starts once the pollers' first burst is answered and lasts past the longest
    Retry-After, so the pollers that were turned away come back inside it."""
    path = f"/train/{job_id}"
    idle = latencies_ms(svc, path, seconds)
    pollers = Pollers(svc, job_id, count, wait_s).start()
    try:
        time.sleep(settle_s)
        before = pollers.count()
        started = time.monotonic()
        loaded = latencies_ms(svc, path, seconds)
        rate = (pollers.count() - before) / (time.monotonic() - started)
    finally:
        pollers.stop()
    rows = []
    for q in (50, 99):
        with_, without = percentile(loaded, q), percentile(idle, q)
        rows.append(Row(f"{count} long pollers: another client's GET /train/<id>, p{q} delay",
                        f"{with_ - without:.1f} ms", f"{without:.2f} ms (p{q} without pollers)", with_ / without,
                        "≤ 50 ms", with_ - without <= 50))
    rows.append(Row(f"{count} long pollers: their requests a second (in the window)", f"{rate:.1f} req/s",
                    f"{count / wait_s:.1f} req/s (one poll per `wait` each)", rate / (count / wait_s)))
    turned = pollers.retry_afters
    notes = [f"{count} pollers with wait={wait_s:g}, {len(turned)} answers with Retry-After "
             f"({min(turned, default=0)}–{max(turned, default=0)} s); the other client's window: {seconds:g} s "
             f"from {settle_s:g} s after the pollers started, {len(loaded)} requests (without them: {len(idle)}); "
             f"max {max(loaded):.1f} ms (without: {max(idle):.1f} ms)"]
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="wrk duration per route and level")
    parser.add_argument("--pollers", type=int, default=256, help="long pollers for the delay rows")
    parser.add_argument("--poll-seconds", type=float, default=30.0,
                        help="the other client's window, with and without the pollers")
    args = parser.parse_args(argv)
    levels, seconds = ([1, 8, 32], args.seconds) if not args.quick else ([1, 8], 1.0)
    pollers, settle_s, poll_seconds, wait_s = ((args.pollers, 3.0, args.poll_seconds, 25.0) if not args.quick
                                               else (16, 0.5, 2.0, 2.0))
    with bench_host() as host, running_service(host) as svc:
        job_id = start_job(svc, host)
        rows, notes = pollers_delay(svc, job_id, pollers, settle_s, poll_seconds, wait_s)
        if shutil.which("wrk") is not None:
            more, more_notes = measure(svc, job_id, levels, seconds)
            rows, notes = more + rows, more_notes + notes
        else:
            notes.append("wrk is not installed (apt-get install -y wrk): the throughput rows were not measured")
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

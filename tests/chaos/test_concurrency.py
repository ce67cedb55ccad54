"""Concurrency: a storm of dispatches admits exactly one job; 20 Hz progress writes under polling and cancels
never produce a 5xx or a "database is locked". CHAOS_SECONDS (default 10) sets the contention window."""
from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections import Counter
from dataclasses import replace

import pytest

from tests.chaos.invariants import TERMINAL, active_rows, integrity_ok
from tests.helpers import set_modes, wait_for
from tests.helpers.service import Service

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SECONDS = float(os.environ.get("CHAOS_SECONDS", "10"))


def _storm(url_port: int, body: dict, count: int, results: multiprocessing.Queue) -> None:
    import http.client
    for _ in range(count):
        conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=30)
        conn.request("POST", "/train", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        results.put((resp.status, json.loads(resp.read())))
        conn.close()


def test_fifty_concurrent_dispatches_admit_exactly_one(host, migrated):
    set_modes(host.sd_scripts, hang_in="training")
    svc = Service(migrated, host.root / "gunicorn.log").start()
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(active_rows(migrated.database_path))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answers: list[tuple[int, dict]] = []
        barrier = threading.Barrier(40)

        def post(i: int) -> None:
            barrier.wait()
            code, body, _ = svc.request("POST", "/train", host.payload(output_name=f"n{i}"))
            answers.append((code, body))

        ctx = multiprocessing.get_context("spawn")
        results: multiprocessing.Queue = ctx.Queue()
        other = ctx.Process(target=_storm, args=(svc.port, host.payload(output_name="other"), 10, results))
        threads = [threading.Thread(target=post, args=(i,)) for i in range(40)]
        other.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        answers += [results.get(timeout=60) for _ in range(10)]
        other.join(30)
        codes = Counter(code for code, _ in answers)
        assert codes == {202: 1, 409: 49}, codes
        assert all(body["error"] == "job_active" for code, body in answers if code == 409)
        winner = next(body["worker_job_id"] for code, body in answers if code == 202)
        assert all(body["details"]["active_job_id"] == winner for code, body in answers if code == 409)
        svc.request("POST", f"/train/{winner}/cancel")
        wait_for(lambda: svc.request("GET", f"/train/{winner}")[1]["status"] == "cancelled", what="cancelled")
    finally:
        stop.set()
        sampler.join()
        svc.stop()
    assert samples and max(samples) <= 1


def test_progress_at_20_hz_under_polling_and_cancels_never_locks_or_fails(host, migrated):
    # The supervisor writes the ledger 20 times a second. Its busy timeout is 2 s here, not the shipped 0.25 s: on a
    # loaded CI runner a cancel's write was once descheduled for longer while it held the lock, and the retried
    # progress write (by design) is not this test's subject; readers never waiting on the writes is.
    busy = replace(migrated, progress_interval_s=0.05, supervisor_busy_timeout_s=2.0)
    svc = Service(busy, host.root / "gunicorn.log").start()
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    stop = threading.Event()
    current = {"id": None}

    def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            job_id = current["id"]
            if job_id is None:
                time.sleep(0.01)
                continue
            for method, path in (("GET", f"/train/{job_id}"), ("GET", f"/train/{job_id}/log?lines=5"),
                                 ("GET", "/train?limit=5"), ("GET", "/healthz")):
                code, body, _ = svc.request(method, path)
                statuses[code] += 1
                if code >= 500:
                    errors.append(f"{method} {path}: {code} {body}")
            i += 1
            if n == 0 and i % 15 == 0:  # one client cancels the running job now and then
                code, body, _ = svc.request("POST", f"/train/{job_id}/cancel")
                statuses[code] += 1
                if code >= 500:
                    errors.append(f"cancel: {code} {body}")

    clients = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in clients:
        t.start()
    runs = 0
    try:
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            set_modes(host.sd_scripts, step_s=0.01)
            code, body, _ = svc.request("POST", "/train", host.payload(output_name=f"r{runs}"))
            assert code == 202, body
            current["id"] = body["worker_job_id"]
            wait_for(lambda: svc.request("GET", f"/train/{current['id']}")[1]["status"] in TERMINAL, timeout=60,
                     what="the run to end")
            runs += 1
    finally:
        stop.set()
        for t in clients:
            t.join(30)
        svc.stop()
    logs = "".join(p.read_text() for p in host.root.glob("gunicorn*.log"))
    assert errors == [] and statuses[503] == 0, (errors, statuses)
    assert "database is locked" not in logs and "ledger unavailable" not in logs and "not written" not in logs
    assert runs >= 1 and sum(statuses.values()) > 100
    assert integrity_ok(migrated.database_path)

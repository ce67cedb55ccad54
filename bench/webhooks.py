"""Benchmark 9, webhooks (issue 27): what the outbox adds to the paths that write events, and what the sender
costs per event.

- `POST /train` answered, with webhooks on (a target and a receiver; the job's `job.queued` written with its
  row, and the web's check that a sender runs) against off, interleaved in the same run, through the app in
  process with a recording launcher (no supervisor: the dispatch path alone).
- A job's ending (the terminal write a supervisor makes) with a subscription against without, interleaved.
- The sender's CPU per event: the real `python -m lora_worker.webhooks` delivering every event of a batch of
  finished jobs to a receiver on loopback (its main thread's on-CPU time from /proc, idle time taken off),
  against a bare `http.client` POST of the same bodies with the same headers, made from this process.
Targets: "no measurable time" is read as within 1.25× of the baseline's median (these machines are noisy).
"""
from __future__ import annotations

import http.client
import statistics
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.common import Row, arg_parser, bench_host, cpu_seconds, emit
from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.states import JobState
from lora_worker.webhooks import signing
from lora_worker.webhooks.process import ensure_sender, sender_lock_path, stop_sender
from lora_worker.host.locks import lock_state
from tests.helpers import Launches, wait_for

RATIO_TARGET = 1.25
SECRET = "whsec_" + "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="


class Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def sink() -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def post_times(host, hooked, runs: int) -> tuple[list[float], list[float]]:
    from lora_worker import create_app

    plain, with_hooks = ([], [])
    clients = {False: create_app(host.settings, launch=Launches()).test_client(),
               True: create_app(hooked, launch=Launches()).test_client()}
    for i in range(runs):
        for on in (i % 2 == 0, i % 2 != 0):  # interleaved, each side first half the time
            client = clients[on]
            started = time.perf_counter()
            answer = client.post("/train", json=host.payload(output_name=f"b{i}{int(on)}"))
            (with_hooks if on else plain).append(time.perf_counter() - started)
            assert answer.status_code == 202, answer.get_json()
            job_id = answer.get_json()["worker_job_id"]
            db = client.application.extensions["lora_worker"].db
            repo.transition(db, job_id, JobState.CANCELLED, actor="api")  # free the one slot
    return plain, with_hooks


def ending_times(hooked, db: Database, runs: int) -> tuple[list[float], list[float]]:
    from tests.webhooks.jobs import subscribed

    ledger = SupervisorLedger(hooked.database_path)
    plain, with_hooks = [], []
    try:
        for i in range(runs):
            for on in (i % 2 == 0, i % 2 != 0):
                columns = subscribed(output_name=f"e{i}{int(on)}")
                if not on:
                    columns["webhook_events"] = None
                job = repo.create_job(db, columns)
                ledger.mark_running(job.id, phase="training")
                started = time.perf_counter()
                ledger.mark_succeeded(job.id, reason="model saved", lora_path="/o/x.safetensors")
                (with_hooks if on else plain).append(time.perf_counter() - started)
    finally:
        ledger.close()
    return plain, with_hooks


def sender_cpu(hooked, db: Database, jobs: int) -> tuple[float, float, int]:
    """(the sender's CPU seconds per event, a bare POST's, events)."""
    from tests.webhooks.jobs import a_finished_job

    ensure_sender(hooked)
    pid = lock_state(sender_lock_path(hooked)).holder_pid
    assert pid is not None
    time.sleep(0.5)
    idle_from, idle_at = cpu_seconds(pid), time.monotonic()
    time.sleep(1.0)
    idle_rate = (cpu_seconds(pid) - idle_from) / (time.monotonic() - idle_at)
    before, started = cpu_seconds(pid), time.monotonic()
    ids = [a_finished_job(db) for _ in range(jobs)]
    wait_for(lambda: all(_delivered(db, i) for i in ids), timeout=300, interval=0.05, what="every event sent")
    took = time.monotonic() - started
    events = 3 * jobs
    per_event = max(0.0, cpu_seconds(pid) - before - idle_rate * took) / events
    stop_sender(hooked)
    with db.reading() as d:
        bodies = [body for job_id in ids[:50] for _, body in outbox.bodies(d, job_id)]
    return per_event, bare_post_cpu(hooked.webhook_url or "", bodies), events


def bare_post_cpu(url: str, bodies: list[str]) -> float:
    target = url.split("//", 1)[1]
    host, _, rest = target.partition("/")
    keys = signing.parse_secrets(SECRET)
    started = time.process_time()
    for n, body in enumerate(bodies):
        conn = http.client.HTTPConnection(*host.split(":"), timeout=5)
        data = body.encode()
        conn.request("POST", "/" + rest, body=data, headers={
            **signing.headers(keys, f"msg_{n}", int(time.time()), data), "content-type": "application/json"})
        conn.getresponse().read(65536)
        conn.close()
    return (time.process_time() - started) / len(bodies)


def _delivered(db: Database, job_id: int) -> bool:
    with db.reading() as d:
        return {e["state"] for e in outbox.deliveries(d, job_id)} == {"delivered"}


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.2f} ms"


def main(argv: list[str]) -> int:
    args = arg_parser(__doc__).parse_args(argv)
    runs, jobs = (4, 5) if args.quick else (40, 100)
    server = sink()
    with bench_host() as host:
        secret = host.root / "webhook_secret"
        secret.write_text(SECRET + "\n")
        secret.chmod(0o600)
        hooked = replace(host.settings, webhook_url=f"http://127.0.0.1:{server.server_address[1]}/hooks",
                         webhook_secret_file=secret)
        plain_post, hooked_post = post_times(host, hooked, runs)
        db = Database.open(hooked.database_path)
        try:
            plain_end, hooked_end = ending_times(hooked, db, runs)
            per_event, bare, events = sender_cpu(hooked, db, jobs)
        finally:
            stop_sender(hooked)
            db.dispose()
    server.shutdown()
    post_ratio = statistics.median(hooked_post) / statistics.median(plain_post)
    end_ratio = statistics.median(hooked_end) / statistics.median(plain_end)
    emit("Webhooks: what the outbox adds, and the sender's CPU per event", [
        Row("POST /train answered, webhooks on / off", ms(hooked_post), ms(plain_post), post_ratio,
            f"≤ {RATIO_TARGET}×", post_ratio <= RATIO_TARGET),
        Row("a job's ending (the supervisor's terminal write), subscribed / not", ms(hooked_end), ms(plain_end),
            end_ratio, f"≤ {RATIO_TARGET}×", end_ratio <= RATIO_TARGET),
        Row(f"sender CPU per event ({events} events), against a bare signed POST", f"{per_event * 1000:.2f} ms",
            f"{bare * 1000:.2f} ms", per_event / bare if bare else None),
    ], notes=[f"medians of {runs} interleaved runs each; the sender is the real process, its idle polling "
              "taken off"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


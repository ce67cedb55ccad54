"""Benchmark 5, memory: peak RSS (VmHWM) of the gunicorn worker and of one supervisor during a run.

Baselines, measured in the same run: a bare Python interpreter (`python -c pass`), the same interpreter
after importing only what the supervisor imports, and the web worker just after start-up. The supervisor is
the real one, over the stream benchmark's emitter (bench/stream.py): a realistic paced run and a 100 MB
flood. The web worker is measured under 1000 long pollers (bench/status.py's, honouring Retry-After) with a
dispatch, a cancel and a few thousand requests on every route meanwhile.
"""
from __future__ import annotations

import json
import subprocess
from urllib.parse import urlsplit

from bench.common import Row, arg_parser, bench_host, emit, peak_rss_mib, python, running_service
from bench.status import Pollers, get
from bench.stream import Runs
from lora_worker.host import processes
from tests.helpers import Host, set_modes, wait_for

# Prints the interpreter's peak RSS (KiB) and the third-party packages loaded, after importing the supervisor.
# VmHWM, not getrusage's ru_maxrss: that one survives exec, so a child would report its parent's size.
PROBE = """
import json, sys
{imports}
top = {{m.split('.')[0] for m in sys.modules}} - set(sys.stdlib_module_names) - {{'lora_worker'}}
hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))
print(json.dumps({{"kib": int(hwm.split()[1]), "third_party": sorted(t for t in top if not t.startswith('_'))}}))
"""
# main.py imports the ledger and the runner only once it holds the job lock; a run loads them all, and what
# only the run's end uses once the trainer runs (runner.load_the_end).
SUPERVISOR_IMPORTS = ("import lora_worker.run.__main__, lora_worker.run.main, lora_worker.run.runner, "
                      "lora_worker.run.seam, lora_worker.ledger.supervisor; lora_worker.run.runner.load_the_end()")
RSS_TARGET_MIB = 25.0  # issue #18 (stdlib sqlite3 was measured at 16–19 MiB)


def probe(imports: str) -> dict:
    out = subprocess.run([python(), "-c", PROBE.format(imports=imports)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def web_worker(host: Host, requests: int, pollers: int) -> tuple[float, float]:
    """(peak RSS just after start-up, peak RSS after the load) of the gunicorn worker, MiB. The load: `pollers`
    clients long-polling the running job as docs/jobs.md says (all at once, then as Retry-After tells them),
    and meanwhile `requests` requests over every route, /metrics and /openapi.json included, and a cancel."""
    with running_service(host) as svc:
        worker = svc.workers()[0]
        idle = peak_rss_mib(worker)
        set_modes(host.sd_scripts, step_s=0.05)
        job_id = svc.request("POST", "/train", host.payload())[1]["worker_job_id"]
        polling = Pollers(svc, job_id, pollers, wait_s=25.0).start()
        try:
            routes = ["/healthz", "/gpu-status", "/train?limit=50", f"/train/{job_id}",
                      f"/train/{job_id}/log?lines=200", "/metrics", "/openapi.json"]
            address = urlsplit(svc.url).netloc
            for i in range(requests):
                assert get(address, routes[i % len(routes)])[0] == 200
            svc.request("POST", f"/train/{job_id}/cancel")
            wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["status"] != "running", timeout=60,
                     what="end")
        finally:
            polling.stop()
        return idle, peak_rss_mib(worker)


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--bytes", type=int, default=100_000_000)
    parser.add_argument("--pollers", type=int, default=1000, help="long pollers during the web worker's load")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.bytes, args.pollers = 20, 200_000, 20
    bare = probe("")["kib"] / 1024
    imported = probe(SUPERVISOR_IMPORTS)
    processes.set_child_subreaper()  # as in bench/stream.py: supervisors are measured as our children
    with bench_host() as host:
        runs = Runs(host)
        try:
            paced = runs.supervised("--redraws", "100" if args.quick else "600", "--rate", "60")
            flood = runs.supervised("--bytes", str(args.bytes))
        finally:
            runs.db.dispose()
        idle, loaded = web_worker(host, args.requests, args.pollers)
    sup_import = imported["kib"] / 1024
    rss = f"< {RSS_TARGET_MIB:g} MiB"
    rows = [
        Row("supervisor, realistic run (paced redraws)", f"{paced.peak_rss_mib:.1f} MiB",
            f"{bare:.1f} MiB (bare python)", paced.peak_rss_mib / bare, rss, paced.peak_rss_mib < RSS_TARGET_MIB),
        Row(f"supervisor, {args.bytes / 1e6:g} MB flood", f"{flood.peak_rss_mib:.1f} MiB",
            f"{paced.peak_rss_mib:.1f} MiB (realistic run)", flood.peak_rss_mib / paced.peak_rss_mib, rss,
            flood.peak_rss_mib < RSS_TARGET_MIB),
        Row("supervisor's imports alone", f"{sup_import:.1f} MiB", f"{bare:.1f} MiB (bare python)", sup_import / bare),
        Row(f"gunicorn worker, {args.pollers} long pollers, {args.requests} requests, a dispatch and a cancel",
            f"{loaded:.1f} MiB", f"{idle:.1f} MiB (after start-up)", loaded / idle, "< 80 MiB", loaded < 80),
    ]
    notes = ["third-party packages the supervisor imports: " + (", ".join(imported["third_party"]) or "none"),
             "no SQLAlchemy, Flask, Werkzeug, marshmallow, apispec or prometheus_client: "
             "tests/run/test_imports.py asserts it"]
    emit("Memory (peak RSS, VmHWM)", rows, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

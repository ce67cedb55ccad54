"""`lora-worker demo` (`make demo`): watch one training end to end on a machine with no GPU and no sd-scripts.

It lays out a simulated host under `var/demo` (the simulated trainer, a 24 GB card running a TTS process and
a 48 GB card, a tiny SDXL checkpoint, a kohya dataset), migrates its ledger, starts the real service
(gunicorn, and the real detached supervisor per job), dispatches a `fast` job over HTTP, shows it live to its
end, checks the LoRA itself, prints the curl commands that repeat each step, and keeps the server up until
Ctrl-C. Nothing here is a shortcut of the service: the demo is a client of the API and a reader of the ledger.

The simulated trainer says what it is: `trainer: simulated` on /healthz and in `doctor`, and the first line of
every run log. It is enabled by LORA_WORKER_TRAINER_KIND, which a deployed worker refuses (lora_worker.config).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shlex
import signal
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from lora_worker.errors import LoraWorkerError
from lora_worker.config import REPO_ROOT, SIMULATED, SIMULATED_ENV
from lora_worker.host.nvml import make_nvml
from lora_worker.host.safetensors import ExpectedLora, verify_lora
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ops import demo_webhooks
from lora_worker.ops import plan as plan_cli
from lora_worker.ops import simulated
from lora_worker.ops.demo_host import (ON_CLUSTER, TRAINER_PACE, DemoError, Host, die_with_parent, prepare_host,
                                       refuse_taken_port, request, say, server, short, tts_stand_in)
from lora_worker.ops.doctor import run_checks
from lora_worker.ops.watch import watch
from lora_worker.transcript.outcome import recorded_lora
from lora_worker.backends import backend_for
from lora_worker.states import JobState

DEFAULT_DIR = REPO_ROOT / "var" / "demo"
DEFAULT_BIND = "127.0.0.1:8204"  # beside `make run`'s 8203, so both can run at once
TIER = "fast"
DEVICE = 1  # the 48 GB card; device 0 carries the TTS process, so the worker refuses it (gpu_busy)
TRIGGER, SUBJECT_CLASS, REPEATS, IMAGES, SEED = "ohwx", "woman", 10, 4, 42


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    demo = sub.add_parser("demo", help="a simulated GPU host: start the service, train one LoRA live, show the API")
    demo.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"where it all lives (default {DEFAULT_DIR})")
    demo.add_argument("--bind", default=DEFAULT_BIND, help=f"the server's address (default {DEFAULT_BIND})")
    demo.add_argument("--step-s", type=float, default=TRAINER_PACE["step_s"],
                      help="seconds per simulated training step (400 steps in the fast tier)")


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """The whole demo. It ends at Ctrl-C (or SIGTERM, SIGHUP), which at any point cancels what it started and stops the
    server: 0 once the job had succeeded, 1 when the demo could not get that far."""
    started = time.monotonic()
    # SIGHUP: the terminal closed. Each stops the demo in order, as Ctrl-C does; so does its parent's death.
    previous = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)}
    die_with_parent()
    succeeded = False
    try:
        refuse_taken_port(args.bind)  # before anything is set up: the one line says who holds it
        root = args.dir.resolve()
        root.mkdir(parents=True, exist_ok=True)
        key = demo_webhooks.write_secret(root / "webhook_secret")
        with tts_stand_in() as tts, demo_webhooks.receiver(key, lambda line: say(out, line)) as hooks:
            host = prepare_host(root, args.bind, tts.pid, args.step_s, out, webhook_url=hooks)
            with server(host, out) as url:
                _show(host, url, started, out)
                succeeded = True
                say(out, "the server stays up: try the commands above in another terminal. Ctrl-C stops it.")
                _sleep_until_signalled()
    except KeyboardInterrupt:
        say(out, "stopped")
    except (DemoError, LoraWorkerError, OSError) as exc:
        say(out, f"FAILED: {getattr(exc, 'message', None) or exc}")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0 if succeeded else 1


def _show(host: Host, url: str, started: float, out: TextIO) -> int:
    """Everything between "the server answers" and "here are the commands": returns the job's id."""
    settings = host.settings
    say(out, f"GET /healthz → {json.dumps(request(url, 'GET', '/healthz')[1])}")
    for check in run_checks(settings, make_nvml(settings.nvml_timeout_s, settings.nvml_fake_file)):
        out.write(f"  doctor {check.line()}\n")
    _, gpus = request(url, "GET", "/gpu-status")
    for d in gpus["devices"]:
        procs = ", ".join(f"{p['name']} (pid {p['pid']}, {p['used_mib']} MiB{', tts' if p['tts'] else ''})"
                          for p in d["processes"]) or "no compute process"
        out.write(f"  GPU {d['index']} {d['name']}: {d['memory_free_mib']}/{d['memory_total_mib']} MiB free, "
                  f"{procs}\n")
    out.write(f"  tts_on_3090: {str(gpus['tts_on_3090']).lower()}\n")

    train_dir = _new_train_dir(settings.train_root)
    dataset = simulated.write_dataset(train_dir, TRIGGER, SUBJECT_CLASS, REPEATS, IMAGES)
    say(out, f"dataset {short(dataset)}/{REPEATS}_{TRIGGER} {SUBJECT_CLASS}: {IMAGES} images with captions")
    body = {
        "dataset_dir": str(dataset), "base_model_path": str(settings.model_dirs[0] / "sdxl_base_simulated.safetensors"),
        "output_dir": str(train_dir / "output"), "output_name": f"{TRIGGER}_lora", "trigger": TRIGGER,
        "subject_class": SUBJECT_CLASS, "repeats": REPEATS, "tier": TIER, "device_index": 0, "seed": SEED,
    }
    if not backend_for(settings).places_here:  # Slurm allocates the GPUs: no admission by this host's NVML to show
        say(out, f"on Slurm (partition {settings.slurm_partition}): the scheduler gives the job its GPU")
    else:
        status, answer = request(url, "POST", "/train", {**body, "device_index": 0})
        say(out, f"POST /train on GPU 0 → {status} {answer.get('error')}: {answer.get('message')}")
    body["device_index"] = DEVICE
    status, plan = request(url, "POST", "/train?dry_run=1", body)
    say(out, f"POST /train?dry_run=1 on GPU {DEVICE} → {status}: the plan, nothing started")
    out.write(textwrap.indent(plan_cli.describe(plan) if status == 200 else plan_cli.refusal(status, plan), "  "))
    status, answer = request(url, "POST", "/train", body)
    say(out, f"POST /train on GPU {DEVICE} → {status} {json.dumps(answer)}")
    if status != 202:
        raise DemoError(f"the worker refused the demo's job: {status} {answer}")
    job_id = int(answer["worker_job_id"])
    (host.root / "request.json").write_text(json.dumps(body, indent=2) + "\n")
    db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s)
    try:
        if watch(db, settings, job_id, out) == 130:
            raise KeyboardInterrupt
    finally:
        db.dispose()
    _, job = request(url, "GET", f"/train/{job_id}")
    if job["status"] != JobState.SUCCEEDED.value:
        raise DemoError(f"job {job_id} ended {job['status']}: {job.get('failure_class')}: {job.get('error')}")
    db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s)
    try:
        expected = recorded_lora(repo.get_job(db, job_id))
    finally:
        db.dispose()
    _verify(job, expected, out)
    say(out, f"a verified LoRA {time.monotonic() - started:.1f} s after the demo started")
    again = {**body, "output_name": f"{TRIGGER}_lora_again"}  # a new name: the first output exists now
    (host.root / "next-request.json").write_text(json.dumps(again, indent=2) + "\n")
    out.write(curl_commands(url, job_id, job["version"], host))
    return job_id


def _verify(job: Mapping[str, Any], expected: ExpectedLora, out: TextIO) -> None:
    """Read the LoRA ourselves against what dispatch recorded: the worker's verdict is not taken on trust."""
    path = Path(job["lora_path"])
    check = verify_lora(path, expected)
    if check.problem:
        raise DemoError(f"the LoRA at {path} is not the one asked for: {check.problem}")
    digest = check.sha256
    if digest is None or digest != job["lora_sha256"]:
        raise DemoError(f"the LoRA at {path} has sha256 {digest}, the ledger says {job['lora_sha256']}")
    md = check.metadata
    say(out, f"verified {short(path)}: {check.size} bytes, sha256 {digest[:16]}…, rank {md['ss_network_dim']}, "
              f"ss_output_name {md['ss_output_name']}, ss_max_train_steps {md['ss_max_train_steps']}, "
              f"ss_seed {md['ss_seed']}")


def curl_commands(url: str, job_id: int, version: int, host: Host) -> str:
    cli = f"LORA_WORKER_CONFIG={shlex.quote(short(host.config))} {SIMULATED_ENV}={SIMULATED} .venv/bin/lora-worker"
    cluster = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(host.env.items())
                       if k.startswith(ON_CLUSTER) or k == "SLURM_CONF" and not backend_for(host.settings).places_here)
    body = shlex.quote("@" + short(host.root / "next-request.json"))
    lines = [
        "",
        "Each step again, by hand (the server runs without a token: loopback only):",
        "  # the plan of another job, nothing started (argv, buckets, states, the dataset lint's warnings)",
        f"  curl -s -X POST '{url}/train?dry_run=1' -H 'Content-Type: application/json' -d {body}",
        "  # dispatch another job (202 and its id; the same body twice: 422 output_exists)",
        f"  curl -s -X POST {url}/train -H 'Content-Type: application/json' -d {body}",
        "  # status, and a long poll that answers as soon as the job changes (or after 25 s)",
        f"  curl -s {url}/train/{job_id}",
        f"  curl -s '{url}/train/{job_id}?since={version}&wait=25'",
        "  # the run log (its first line says the trainer is simulated), and the loss curve",
        f"  curl -s '{url}/train/{job_id}/log?lines=20'",
        f"  curl -s '{url}/train/{job_id}/progress?points=20'",
        f"  # cancel (202 while it runs; 409 job_finished once it has ended, as job {job_id} has)",
        f"  curl -s -X POST {url}/train/{job_id}/cancel",
        "  # the GPUs, and the service's health",
        f"  curl -s {url}/gpu-status",
        f"  curl -s {url}/healthz",
        "  # the operator's view, from the ledger" + (f" (the cluster's settings first: export {cluster})"
                                                     if cluster else ""),
        f"  {cli} jobs watch        # the active job, live",
        f"  {cli} jobs show {job_id}",
        f"  {cli} doctor",
        "",
    ]
    return "\n".join(lines) + "\n"


def _new_train_dir(train_root: Path) -> Path:
    """`demo-N`, N one past the last: each run trains into a fresh folder, so earlier LoRAs are kept."""
    numbers = [int(p.name[5:]) for p in train_root.glob("demo-*") if p.name[5:].isdigit()]
    path = train_root / f"demo-{max(numbers, default=0) + 1}"
    path.mkdir()
    return path


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _sleep_until_signalled() -> None:
    """Block until a signal's handler raises. Not `time.sleep`: CPython runs handlers in the main thread only, and
    a signal the kernel gives to another thread (the webhook receiver's) would not wake a sleep, so the demo
    would outlive the make or shell above it by an hour. The wakeup fd is written whichever thread takes it."""
    readable, writable = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    previous = signal.set_wakeup_fd(writable, warn_on_full_buffer=False)
    try:
        while True:
            select.select([readable], [], [])
            os.read(readable, 512)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(readable)
        os.close(writable)

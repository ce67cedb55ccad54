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
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from lora_worker.errors import LoraWorkerError
from lora_worker.config import ENV_PREFIX, REPO_ROOT, SIMULATED, SIMULATED_ENV, Settings, load_settings
from lora_worker.host.locks import lock_state
from lora_worker.host.nvml import make_nvml
from lora_worker.host.safetensors import ExpectedLora, verify_lora
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import current_revision, prepare_state_dir, upgrade
from lora_worker.ops import simulated
from lora_worker.ops.doctor import run_checks
from lora_worker.ops.watch import watch
from lora_worker.transcript.outcome import recorded_lora
from lora_worker.backends import backend_for
from lora_worker.slurm.process import poller_lock_path
from lora_worker.states import ACTIVE_STATES, JobState

DEFAULT_DIR = REPO_ROOT / "var" / "demo"
DEFAULT_BIND = "127.0.0.1:8204"  # beside `make run`'s 8203, so both can run at once
START_TIMEOUT_S = 60.0
TIER = "fast"
DEVICE = 1  # the 48 GB card; device 0 carries the TTS process, so the worker refuses it (gpu_busy)
TRIGGER, SUBJECT_CLASS, REPEATS, IMAGES, SEED = "ohwx", "woman", 10, 4, 42
# The simulated phases, in seconds: the fake's knobs (its step count is the tier's, 400; TIERS are untouched).
TRAINER_PACE = {"launcher_delay_s": 1.0, "load_s": 0.4, "cache_s": 0.1, "sha_s": 1.0, "step_s": 0.03}
ON_CLUSTER = (ENV_PREFIX + "BACKEND", ENV_PREFIX + "MAX_ACTIVE_JOBS", ENV_PREFIX + "SLURM_")


class DemoError(Exception):
    """The demo could not go on; the message says why and what to do."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    demo = sub.add_parser("demo", help="a simulated GPU host: start the service, train one LoRA live, show the API")
    demo.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"where it all lives (default {DEFAULT_DIR})")
    demo.add_argument("--bind", default=DEFAULT_BIND, help=f"the server's address (default {DEFAULT_BIND})")
    demo.add_argument("--step-s", type=float, default=TRAINER_PACE["step_s"],
                      help="seconds per simulated training step (400 steps in the fast tier)")


@dataclass
class Host:
    """The simulated host's files, and the environment that points the worker at them."""

    root: Path
    config: Path
    env: dict[str, str]
    settings: Settings


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """The whole demo. It ends at Ctrl-C (or SIGTERM), which at any point cancels what it started and stops the
    server: 0 once the job had succeeded, 1 when the demo could not get that far."""
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    succeeded = False
    try:
        with _tts_stand_in() as tts:
            host = prepare_host(args.dir.resolve(), args.bind, tts.pid, args.step_s, out)
            with _server(host, out) as url:
                _show(host, url, started, out)
                succeeded = True
                _say(out, "the server stays up: try the commands above in another terminal. Ctrl-C stops it.")
                while True:
                    time.sleep(3600)
    except KeyboardInterrupt:
        _say(out, "stopped")
    except (DemoError, LoraWorkerError, OSError) as exc:
        _say(out, f"FAILED: {getattr(exc, 'message', None) or exc}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if succeeded else 1


def prepare_host(root: Path, bind: str, tts_pid: int, step_s: float, out: TextIO) -> Host:
    _say(out, f"simulated host in {_short(root)}")
    trainer = simulated.install_simulated_trainer(root / "trainer")
    simulated.set_trainer_modes(trainer["sd_scripts_dir"], **{**TRAINER_PACE, "step_s": step_s})
    simulated.write_base_model(root / "models" / "sdxl_base_simulated.safetensors")
    simulated.make_shared_dir(root / "train")
    simulated.write_gpus(root / "gpus.json", tts_pid)
    # The trainer runs in its bubblewrap sandbox where bubblewrap is installed, as deployed; without it the
    # demo still runs, and says so.
    sandbox = "bwrap" if shutil.which("bwrap") else "none"
    if sandbox == "none":
        _say(out, "bubblewrap (bwrap) is not installed: the trainer runs WITHOUT its sandbox here "
                  "(install it with: sudo apt-get install bubblewrap)")
    values: dict[str, Any] = {
        "state_dir": root, "train_root": root / "train", "model_dirs": [root / "models"],
        "nvml_fake_file": root / "gpus.json", "bind": bind, "sandbox": sandbox, **trainer,
    }
    config = root / "worker.toml"
    # JSON strings and lists of them are valid TOML for these plain values.
    config.write_text("# Written by `lora-worker demo` at each run: a simulated host (no GPU, no sd-scripts).\n"
                      f"# The trainer kind is not here: a config file may not say it; {SIMULATED_ENV} does.\n"
                      + "".join(f"{key} = {json.dumps(_plain(v))}\n" for key, v in values.items()))
    # Only our settings: a LORA_WORKER_* left in the caller's shell must not point the demo elsewhere. Except
    # where the jobs run (LORA_WORKER_BACKEND=slurm, LORA_WORKER_SLURM_*, with SLURM_CONF): the caller's cluster.
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) or k.startswith(ON_CLUSTER)}
    env.update({ENV_PREFIX + "CONFIG": str(config), SIMULATED_ENV: SIMULATED})
    settings = load_settings(env)
    prepare_state_dir(settings)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # one line below says where the ledger is
    upgrade(settings.database_path)
    _say(out, f"config {_short(config)} + {SIMULATED_ENV}={SIMULATED}; ledger {_short(settings.database_path)} "
              f"at schema {current_revision(settings.database_path)}")
    _say(out, "trainer: simulated (tests/fakes: sd-scripts' flags, output, process tree and LoRA file; "
              "it learns nothing)")
    return Host(root=root, config=config, env=env, settings=settings)


def _show(host: Host, url: str, started: float, out: TextIO) -> int:
    """Everything between "the server answers" and "here are the commands": returns the job's id."""
    settings = host.settings
    _say(out, f"GET /healthz → {json.dumps(_request(url, 'GET', '/healthz')[1])}")
    for check in run_checks(settings, make_nvml(settings.nvml_timeout_s, settings.nvml_fake_file)):
        out.write(f"  doctor {check.line()}\n")
    _, gpus = _request(url, "GET", "/gpu-status")
    for d in gpus["devices"]:
        procs = ", ".join(f"{p['name']} (pid {p['pid']}, {p['used_mib']} MiB{', tts' if p['tts'] else ''})"
                          for p in d["processes"]) or "no compute process"
        out.write(f"  GPU {d['index']} {d['name']}: {d['memory_free_mib']}/{d['memory_total_mib']} MiB free, "
                  f"{procs}\n")
    out.write(f"  tts_on_3090: {str(gpus['tts_on_3090']).lower()}\n")

    train_dir = _new_train_dir(settings.train_root)
    dataset = simulated.write_dataset(train_dir, TRIGGER, SUBJECT_CLASS, REPEATS, IMAGES)
    _say(out, f"dataset {_short(dataset)}/{REPEATS}_{TRIGGER} {SUBJECT_CLASS}: {IMAGES} images with captions")
    body = {
        "dataset_dir": str(dataset), "base_model_path": str(settings.model_dirs[0] / "sdxl_base_simulated.safetensors"),
        "output_dir": str(train_dir / "output"), "output_name": f"{TRIGGER}_lora", "trigger": TRIGGER,
        "subject_class": SUBJECT_CLASS, "repeats": REPEATS, "tier": TIER, "device_index": 0, "seed": SEED,
    }
    if not backend_for(settings).places_here:  # Slurm allocates the GPUs: no admission by this host's NVML to show
        _say(out, f"on Slurm (partition {settings.slurm_partition}): the scheduler gives the job its GPU")
    else:
        status, answer = _request(url, "POST", "/train", {**body, "device_index": 0})
        _say(out, f"POST /train on GPU 0 → {status} {answer.get('error')}: {answer.get('message')}")
    body["device_index"] = DEVICE
    status, answer = _request(url, "POST", "/train", body)
    _say(out, f"POST /train on GPU {DEVICE} → {status} {json.dumps(answer)}")
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
    _, job = _request(url, "GET", f"/train/{job_id}")
    if job["status"] != JobState.SUCCEEDED.value:
        raise DemoError(f"job {job_id} ended {job['status']}: {job.get('failure_class')}: {job.get('error')}")
    db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s)
    try:
        expected = recorded_lora(repo.get_job(db, job_id))
    finally:
        db.dispose()
    _verify(job, expected, out)
    _say(out, f"a verified LoRA {time.monotonic() - started:.1f} s after the demo started")
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
    if digest != job["lora_sha256"]:
        raise DemoError(f"the LoRA at {path} has sha256 {digest}, the ledger says {job['lora_sha256']}")
    md = check.metadata
    _say(out, f"verified {_short(path)}: {check.size} bytes, sha256 {digest[:16]}…, rank {md['ss_network_dim']}, "
              f"ss_output_name {md['ss_output_name']}, ss_max_train_steps {md['ss_max_train_steps']}, "
              f"ss_seed {md['ss_seed']}")


def curl_commands(url: str, job_id: int, version: int, host: Host) -> str:
    cli = f"LORA_WORKER_CONFIG={shlex.quote(_short(host.config))} {SIMULATED_ENV}={SIMULATED} .venv/bin/lora-worker"
    cluster = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(host.env.items())
                       if k.startswith(ON_CLUSTER) or k == "SLURM_CONF" and not backend_for(host.settings).places_here)
    body = shlex.quote("@" + _short(host.root / "next-request.json"))
    lines = [
        "",
        "Each step again, by hand (the server runs without a token: loopback only):",
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


# -- the pieces that run beside us -----------------------------------------------------------------------------

@contextmanager
def _tts_stand_in() -> Iterator[subprocess.Popen[bytes]]:
    proc = simulated.start_tts_stand_in()
    try:
        yield proc
    finally:
        simulated.stop_process(proc)


@contextmanager
def _server(host: Host, out: TextIO) -> Iterator[str]:
    """gunicorn with the shipped config, as `make run` starts it; on the way out, our jobs are cancelled first."""
    url = "http://" + host.settings.bind
    try:
        _request(url, "GET", "/healthz", timeout=1)
    except OSError:
        pass
    else:
        raise DemoError(f"something already answers on {host.settings.bind}: stop it, or pass --bind HOST:PORT")
    log_path = host.root / "server.log"
    gunicorn = Path(sys.executable).parent / "gunicorn"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [str(gunicorn), "-c", str(REPO_ROOT / "systemd" / "gunicorn.conf.py"), "lora_worker.wsgi:app"],
            env=host.env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)  # Ctrl-C reaches the demo only; it stops the server in order
    try:
        _wait_until_up(url, proc, log_path)
        _say(out, f"server up: {url} (gunicorn pid {proc.pid}; its log: {_short(log_path)})")
        _cancel_active(host, url, out)  # a job an earlier demo left running (killed, not stopped) holds the slot
        yield url
    finally:
        _cancel_active(host, url, out)
        simulated.stop_process(proc, grace_s=30.0)
        if not backend_for(host.settings).places_here:
            _stop_poller(host.settings)
        _say(out, f"server stopped; the ledger, run logs and LoRAs stay in {_short(host.root)}")


def _wait_until_up(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the server exited ({proc.returncode}); its log ends:\n{_tail(log_path)}")
        try:
            if _request(url, "GET", "/healthz", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise DemoError(f"the server did not answer in {START_TIMEOUT_S:g}s; its log ends:\n{_tail(log_path)}")


def _cancel_active(host: Host, url: str, out: TextIO) -> None:
    """Stop what the demo started: a job left running would outlive the server (supervisors are detached)."""
    db = Database.open(host.settings.database_path, busy_timeout_s=host.settings.busy_timeout_s)
    try:
        active = [j.id for j in repo.active_jobs(db)]
        for job_id in active:
            try:
                _request(url, "POST", f"/train/{job_id}/cancel")
                _say(out, f"job {job_id}: cancel requested")
            except OSError:
                pass
        deadline = time.monotonic() + host.settings.cancel_grace_s + 30
        while active and time.monotonic() < deadline:
            time.sleep(0.2)
            active = [i for i in active if JobState(repo.get_job(db, i).status) in ACTIVE_STATES]
    finally:
        db.dispose()


def _stop_poller(settings: Settings) -> None:
    """The Slurm poller outlives the web by design; the demo's own has nothing left to follow."""
    pid = lock_state(poller_lock_path(settings)).holder_pid
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


# -- helpers ---------------------------------------------------------------------------------------------------

def _request(url: str, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own loopback URL
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _new_train_dir(train_root: Path) -> Path:
    """`demo-N`, N one past the last: each run trains into a fresh folder, so earlier LoRAs are kept."""
    numbers = [int(p.name[5:]) for p in train_root.glob("demo-*") if p.name[5:].isdigit()]
    path = train_root / f"demo-{max(numbers, default=0) + 1}"
    path.mkdir()
    return path


def _short(path: Path) -> str:
    """A path relative to the working directory when it is under it: what a newcomer can paste."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _say(out: TextIO, message: str) -> None:
    out.write(f"demo: {message}\n")
    out.flush()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt

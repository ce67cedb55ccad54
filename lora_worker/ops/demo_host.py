"""The demo's simulated host (`lora-worker demo`, ops/demo.py narrates): its files and settings, the TTS
stand-in and the server beside it, and what makes them die with the demo.

Everything the demo starts dies with it, however it ends: Ctrl-C, SIGTERM, SIGHUP (the terminal closed) or a
SIGKILL of the demo or of the `make` above it. The demo asks the kernel for SIGTERM when its parent dies, and
its children (gunicorn, the TTS stand-in) for SIGTERM when the demo dies (PR_SET_PDEATHSIG), so nothing outlives
it even when it has no chance to clean up. The webhook sender, detached so that it outlives a web restart, is
told to die with the demo (webhooks/lifeline.py): it stops once the demo is gone, whatever killed it. A job's
supervisor is the exception by design (detached, it outlives the web); the demo cancels its jobs on every way
out it gets to run.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil

from lora_worker.backends import backend_for
from lora_worker.config import ENV_PREFIX, REPO_ROOT, SIMULATED, SIMULATED_ENV, Settings, load_settings
from lora_worker.host.locks import lock_state
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import current_revision, prepare_state_dir, upgrade
from lora_worker.ops import simulated
from lora_worker.slurm.process import poller_lock_path
from lora_worker.webhooks.lifeline import LIFELINE_ENV, lifeline_of
from lora_worker.webhooks.process import stop_sender
from lora_worker.states import ACTIVE_STATES, JobState

START_TIMEOUT_S = 60.0
# The simulated phases, in seconds: the fake's knobs (its step count is the tier's, 400; TIERS are untouched).
TRAINER_PACE = {"launcher_delay_s": 1.0, "load_s": 0.4, "cache_s": 0.1, "sha_s": 1.0, "step_s": 0.03}
ON_CLUSTER = (ENV_PREFIX + "BACKEND", ENV_PREFIX + "MAX_ACTIVE_JOBS", ENV_PREFIX + "SLURM_")
PR_SET_PDEATHSIG = 1


class DemoError(Exception):
    """The demo could not go on; the message says why and what to do."""


@dataclass
class Host:
    """The simulated host's files, and the environment that points the worker at them."""

    root: Path
    config: Path
    env: dict[str, str]
    settings: Settings


def prepare_host(root: Path, bind: str, tts_pid: int, step_s: float, out: TextIO,
                 webhook_url: str | None = None) -> Host:
    say(out, f"simulated host in {short(root)}")
    trainer = simulated.install_simulated_trainer(root / "trainer")
    simulated.set_trainer_modes(trainer["sd_scripts_dir"], **{**TRAINER_PACE, "step_s": step_s})
    simulated.write_base_model(root / "models" / "sdxl_base_simulated.safetensors")
    simulated.make_shared_dir(root / "train")
    simulated.write_gpus(root / "gpus.json", tts_pid)
    # The trainer runs in its bubblewrap sandbox where bubblewrap is installed, as deployed; without it the
    # demo still runs, and says so.
    sandbox = "bwrap" if shutil.which("bwrap") else "none"
    if sandbox == "none":
        say(out, "bubblewrap (bwrap) is not installed: the trainer runs WITHOUT its sandbox here "
                  "(install it with: sudo apt-get install bubblewrap)")
    values: dict[str, Any] = {
        "state_dir": root, "train_root": root / "train", "model_dirs": [root / "models"],
        "nvml_fake_file": root / "gpus.json", "bind": bind, "sandbox": sandbox, **trainer,
    }
    if webhook_url:  # the demo's own receiver (demo_webhooks.py): each event of the job printed as it arrives
        values.update(webhook_url=webhook_url, webhook_secret_file=root / "webhook_secret",
                      webhook_progress_interval_s=2.0)
        say(out, f"webhooks: {webhook_url} (a receiver in this process; signed with {short(root)}/webhook_secret)")
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
    say(out, f"config {short(config)} + {SIMULATED_ENV}={SIMULATED}; ledger {short(settings.database_path)} "
              f"at schema {current_revision(settings.database_path)}")
    say(out, "trainer: simulated (tests/fakes: sd-scripts' flags, output, process tree and LoRA file; "
              "it learns nothing)")
    say(out, f"the CLI reads this ledger with: export {ENV_PREFIX}CONFIG={short(config)} {SIMULATED_ENV}={SIMULATED}")
    return Host(root=root, config=config, env=env, settings=settings)


@contextmanager
def tts_stand_in() -> Iterator[subprocess.Popen[bytes]]:
    proc = simulated.start_tts_stand_in(preexec_fn=_die_with_the_demo)
    try:
        yield proc
    finally:
        simulated.stop_process(proc)


@contextmanager
def server(host: Host, out: TextIO) -> Iterator[str]:
    """gunicorn with the shipped config, as `make run` starts it; on the way out, our jobs are cancelled first."""
    url = "http://" + host.settings.bind
    refuse_taken_port(host.settings.bind)
    log_path = host.root / "server.log"
    gunicorn = Path(sys.executable).parent / "gunicorn"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv
            [str(gunicorn), "-c", str(REPO_ROOT / "systemd" / "gunicorn.conf.py"), "lora_worker.wsgi:app"],
            # The sender the web starts dies with the demo (webhooks/lifeline.py), not with this web.
            env={**host.env, LIFELINE_ENV: lifeline_of(os.getpid())}, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops the server in order
            preexec_fn=_die_with_the_demo)
    try:
        _wait_until_up(url, proc, log_path)
        say(out, f"server up: {url} (gunicorn pid {proc.pid}; its log: {short(log_path)})")
        _cancel_active(host, url, out)  # a job an earlier demo left running (killed, not stopped) holds the slot
        yield url
    finally:
        _cancel_active(host, url, out)
        simulated.stop_process(proc, grace_s=30.0)
        if not backend_for(host.settings).places_here:  # the Slurm poller outlives the web by design
            _stop_poller(host.settings)
        stop_sender(host.settings)  # at once: it would stop with the demo anyway
        say(out, f"server stopped; the ledger, run logs and LoRAs stay in {short(host.root)}")


def _wait_until_up(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the server exited ({proc.returncode}); its log ends:\n{_tail(log_path)}")
        try:
            if request(url, "GET", "/healthz", timeout=2)[0] == 200:
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
                request(url, "POST", f"/train/{job_id}/cancel")
                say(out, f"job {job_id}: cancel requested")
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


def request(url: str, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
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


def short(path: Path) -> str:
    """A path relative to the working directory when it is under it: what a newcomer can paste."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def say(out: TextIO, message: str) -> None:
    try:
        out.write(f"demo: {message}\n")
        out.flush()
    except OSError:
        pass  # the terminal is gone (SIGHUP): the demo still stops what it started


def refuse_taken_port(bind: str) -> None:
    """A port someone holds is one line naming the holder, and how to pick another (`make demo PORT=…`)."""
    host, _, port = bind.rpartition(":")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds: TIME_WAIT is no holder
        try:
            probe.bind((host.strip("[]"), int(port)))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise DemoError(f"port {port} is taken by {port_holder(int(port))}: stop it, or pick another port "
                            f"(make demo PORT=8214, or lora-worker demo --bind 127.0.0.1:8214)") from None


def port_holder(port: int) -> str:
    """The process listening on `port`, as `pid N (command line)`, from the kernel's socket table."""
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                try:
                    command = " ".join(psutil.Process(conn.pid).cmdline()) or psutil.Process(conn.pid).name()
                except psutil.Error:
                    command = "?"
                return f"pid {conn.pid} ({command[:120]})"
    except psutil.AccessDenied:
        pass
    return "another process (one this user cannot see: try `sudo ss -ltnp`)"


def die_with_parent() -> None:
    """SIGTERM to the demo when its parent dies (the `make` above it killed, the shell gone), which stops it in
    order, as Ctrl-C does. Its parent may already be gone by now: then stop at once."""
    parent = os.getppid()
    _pdeathsig(signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _die_with_the_demo() -> None:
    """In a child, between fork and exec: SIGTERM when the demo dies, even by SIGKILL."""
    _pdeathsig(signal.SIGTERM)


def _pdeathsig(signum: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)

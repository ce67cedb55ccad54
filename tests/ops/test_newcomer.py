"""What a newcomer meets first: `make demo PORT=…`; a taken port is one line naming its holder; the demo and
everything it started die with the terminal (a closed pty, SIGHUP) or with the process above it (make, a shell)
killed, its detached webhook sender too, even when the demo's whole group is SIGKILLed; `make run` on a
non-loopback bind without a token is a one-line refusal; and a CLI pointed at no ledger says which settings it
read before advising `migrate`."""
from __future__ import annotations

import ctypes
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lora_worker.config import REPO_ROOT, SIMULATED, SIMULATED_ENV, load_settings
from lora_worker.host.locks import lock_state
from lora_worker.webhooks.process import sender_lock_path
from tests.helpers.deploy import recipe
from tests.helpers.service import free_port

pytestmark = pytest.mark.slow  # every test here starts real processes

LORA_WORKER = str(Path(sys.executable).parent / "lora-worker")
UP = b"the server stays up"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("LORA_WORKER_") and k not in ("INVOCATION_ID", "CREDENTIALS_DIRECTORY")}


def demo_argv(tmp_path: Path, port: int) -> list[str]:
    return [LORA_WORKER, "demo", "--dir", str(tmp_path / "demo"), "--bind", f"127.0.0.1:{port}", "--step-s", "0.002"]


def read_until(fd: int, marker: bytes, timeout_s: float = 120) -> bytes:
    seen, deadline = b"", time.monotonic() + timeout_s
    while marker not in seen:
        assert time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
        if select.select([fd], [], [], 1)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, seen.decode(errors="replace")[-3000:]
            seen += chunk
    return seen


# The longest the demo's stop may take by its own code: gunicorn gets 30 s before a SIGKILL, the webhook sender 10 s
# (demo_host.server). A quiet machine takes ~2 s; a loaded CI runner has taken over 15.
STOP_BOUND_S = 45


def assert_all_gone(procs: list[psutil.Process], timeout_s: float = STOP_BOUND_S) -> None:
    deadline = time.monotonic() + timeout_s
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.2)
    assert not alive, [(p.pid, p.cmdline(), _where(p)) for p in alive]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _where(proc: psutil.Process) -> dict[int, str]:
    """What each of a survivor's threads waits in (a failure's first question)."""
    waits = {}
    for thread in proc.threads():
        try:
            waits[thread.id] = Path(f"/proc/{proc.pid}/task/{thread.id}/wchan").read_text()
        except OSError:
            pass
    return waits


def test_make_demo_takes_a_port(tmp_path):
    (line,) = [line for line in recipe("demo", tmp_path / "venv", PORT="8299") if "lora-worker demo" in line]
    assert line.endswith("lora-worker demo --bind 127.0.0.1:8299")
    (line,) = [line for line in recipe("demo", tmp_path / "venv") if "lora-worker demo" in line]
    assert "--bind" not in line  # the demo's own default, 127.0.0.1:8204


def test_a_taken_port_is_one_line_naming_its_holder(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(demo_argv(tmp_path, port), capture_output=True, text=True, env=clean_env(),
                                timeout=60)
    assert result.returncode == 1
    (line,) = result.stdout.splitlines()
    assert line.startswith(f"demo: FAILED: port {port} is taken by pid {os.getpid()} (") and "python" in line, line
    assert "make demo PORT=" in line


def test_the_demo_and_all_it_started_die_when_its_terminal_closes(tmp_path):
    pid, master = pty.fork()
    if pid == 0:  # the child: the demo, its terminal the pty
        os.execve(LORA_WORKER, demo_argv(tmp_path, free_port()), clean_env())
    try:
        output = read_until(master, UP)
        assert b"export LORA_WORKER_CONFIG=" in output  # how to point the CLI at its ledger
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        assert any("gunicorn" in " ".join(p.cmdline()) for p in family[1:])
        assert len(family) >= 4  # the demo, the TTS stand-in, gunicorn's master and its worker
    finally:
        os.close(master)  # the terminal closes: SIGHUP
    assert_all_gone(family)
    os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "tgkill"), reason="no tgkill in this libc")
def test_the_demo_stops_on_a_sigterm_another_of_its_threads_takes(tmp_path):
    # A signal to the process may be given to any thread that does not block it; CPython runs the handler in the
    # main thread only, when it next runs bytecode. Sent straight to the webhook receiver's thread, it must still
    # wake the demo's main thread (a plain sleep would keep it asleep for an hour).
    demo = subprocess.Popen(demo_argv(tmp_path, free_port()), env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        read_until(demo.stdout.fileno(), UP)
        family = [psutil.Process(demo.pid), *psutil.Process(demo.pid).children(recursive=True)]
        (receiver, *_) = [t.id for t in family[0].threads() if t.id != demo.pid]
        assert ctypes.CDLL(None, use_errno=True).tgkill(demo.pid, receiver, signal.SIGTERM) == 0
        assert demo.wait(STOP_BOUND_S) == 0
        assert_all_gone(family)
        assert b"demo: stopped" in demo.stdout.read()
    finally:
        if demo.poll() is None:
            demo.kill()
        demo.stdout.close()


def test_the_demos_webhook_sender_dies_when_the_demos_whole_group_is_sigkilled(tmp_path):
    # A terminal closed the hard way: `kill -9 -- -PGID`. Nothing of the demo runs to stop the sender, which is
    # detached (a session of its own, so the group's SIGKILL misses it): it must see the demo go by itself.
    demo = subprocess.Popen(demo_argv(tmp_path, free_port()), env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        read_until(demo.stdout.fileno(), UP)
        settings = load_settings({"LORA_WORKER_CONFIG": str(tmp_path / "demo" / "worker.toml"),
                                  SIMULATED_ENV: SIMULATED})
        sender = lock_state(sender_lock_path(settings)).holder_pid
        assert sender is not None, "the demo's web started no webhook sender"
        assert os.getsid(sender) != os.getsid(demo.pid)  # outside the group: the kill below does not reach it
        survivor = psutil.Process(sender)
        os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
        assert_all_gone([survivor])
    finally:
        if demo.poll() is None:
            demo.kill()
        demo.stdout.close()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_demo_and_all_it_started_die_when_make_above_it_is_killed(tmp_path):
    # `make demo` as the Makefile runs it (its recipe: exec lora-worker demo), with this venv; SIGKILL leaves the
    # demo no chance to clean up: the kernel tells it (and its children) that the parent died.
    demo_dir, bin_dir = tmp_path / "demo", tmp_path / "bin"
    bin_dir.mkdir()
    # The recipe's lora-worker, with a temporary demo dir instead of the checkout's var/demo; the demo extra is
    # this venv's already.
    (bin_dir / "lora-worker").write_text(f"#!/bin/sh\nexec {LORA_WORKER} \"$@\" --dir {demo_dir} --step-s 0.002\n")
    (bin_dir / "lora-worker").chmod(0o755)
    wrapper = tmp_path / "Makefile"
    wrapper.write_text(f"include {REPO_ROOT / 'Makefile'}\n$(VENV)/.demo-installed:\n\t@true\n"
                       f"demo: override BIN := {bin_dir}\n")
    argv = ["make", "--no-print-directory", "-f", str(wrapper), "demo", f"VENV={tmp_path / 'venv'}",
            f"PORT={free_port()}"]
    make = subprocess.Popen(argv, cwd=REPO_ROOT, env={**clean_env(), "MAKEFLAGS": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        read_until(make.stdout.fileno(), UP)
        family = psutil.Process(make.pid).children(recursive=True)
        assert any("demo" in " ".join(p.cmdline()) for p in family), [p.cmdline() for p in family]
        make.kill()
        make.wait()
        assert_all_gone(family)
    finally:
        if make.poll() is None:
            make.kill()
        make.stdout.close()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_on_an_open_bind_without_a_token_is_a_one_line_refusal(tmp_path):
    env = {**clean_env(), "LORA_WORKER_STATE_DIR": str(tmp_path / "state")}
    result = subprocess.run(["make", "--no-print-directory", "run", f"BIND=0.0.0.0:{free_port()}",
                             f"VENV={Path(sys.executable).parent.parent}"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr and "gunicorn" not in result.stdout + result.stderr
    ours = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("lora-worker")]
    assert len(ours) == 1 and "no API token, and 0.0.0.0:" in ours[0] and "is not loopback" in ours[0], ours
    assert not (tmp_path / "state").exists()  # refused before migrate made anything


def test_a_cli_on_the_built_in_settings_says_so_before_advising_migrate(tmp_path):
    env = clean_env()
    result = subprocess.run([LORA_WORKER, "jobs", "ls"], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=60)
    if result.returncode == 0:
        pytest.skip("this checkout has a ledger under its built-in state dir")
    (line,) = result.stderr.splitlines()
    assert "neither LORA_WORKER_CONFIG nor LORA_WORKER_STATE_DIR is set" in line
    assert "LORA_WORKER_CONFIG=var/demo/worker.toml" in line

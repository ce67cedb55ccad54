"""The local backend (see backends.py): a job's supervisor started from the web process, detached, and
reaped before we return; it attends the job while it holds the job's lock.

Both ends of its two messages live here: the ready pipe the web's POST waits on (`start_detached`), and the
wake-up the web's cancel sends the running supervisor (`wake_supervisor`, `listen_for_wakeups`). The supervisor
imports this module before it takes the job lock, so it imports nothing heavy at the top.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

from lora_worker.config import Settings, settings_to_json
from lora_worker.errors import LaunchFailed
from lora_worker.host.locks import is_locked, job_lock_path
from lora_worker.host.detach import JOB_LOCK_ENV, READY, READY_FD_FLAG

if TYPE_CHECKING:
    import subprocess

Launch = Callable[[int, Settings], None]

SETTINGS_ENV = "LORA_WORKER_SETTINGS"
LAUNCH_TIMEOUT_S = 20.0
# The cancel's wake-up. Its default action is to be ignored, so a wake-up that reaches a process not (or not
# yet) listening for it does nothing at all; SIGUSR1 would kill it.
WAKE_SIGNAL = signal.SIGURG


def launch_supervisor(job_id: int, settings: Settings) -> None:
    """Start `python -m lora_worker.run <job_id>` and return once it holds the job's lock."""
    env = dict(os.environ)
    env[SETTINGS_ENV] = settings_to_json(settings)
    env["PYTHONPATH"] = supervisor_path()
    env[JOB_LOCK_ENV] = str(job_lock_path(settings, job_id))  # taken before anything else is imported there
    # -S: no `site` (its .pth files and the editable install's finder were a third of the supervisor's start,
    # which the POST waits for); the supervisor imports nothing outside the standard library and this package.
    start_detached([sys.executable, "-S", "-m", "lora_worker.run", str(job_id)], env,
                   what=f"The supervisor for job {job_id}", job_id=job_id)


def supervisor_path() -> str:
    """The import path a supervisor started with -S needs: this package's own parent first (an editable
    install puts it on no path entry), then the web's own path, so what it finds is what the web found."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(dict.fromkeys([here, *(p for p in sys.path if p)]))


def start_detached(argv: list[str], env: dict[str, str], *, what: str, job_id: int | None = None,
                   timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
    """Run `argv --ready-fd=N` and return as soon as it writes READY on fd N, or raise LaunchFailed.

    New session (our signals and terminal never reach it), stdin from /dev/null, no inherited descriptors
    but stderr (journald) and the ready pipe. The wait is on the pipe (poll(2)), so it ends when the byte
    lands, and at once with an EOF if every process that held the pipe died without writing it. The process
    we started is only the first of a double fork: it is reaped here (a pidfd tells when it has exited), so
    nothing is left for the web worker to reap later: no zombie, whatever gunicorn does with SIGCHLD.
    """
    import subprocess  # here, not above: the supervisor imports this module before it takes its lock

    deadline = time.monotonic() + timeout_s
    ready_r, ready_w = os.pipe()  # both close-on-exec: only the child gets ready_w, through pass_fds
    try:
        try:
            proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                [*argv, f"{READY_FD_FLAG}{ready_w}"], pass_fds=(ready_w,),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                env=env,
            )
        except OSError as exc:
            raise LaunchFailed(f"Cannot start {what.lower()}: {exc}", job_id=job_id) from exc
        finally:
            os.close(ready_w)  # else our own copy would keep the pipe open: no EOF when the child dies
        said = os.read(ready_r, 1) if _readable(ready_r, deadline) else None
    finally:
        os.close(ready_r)
    rc = _reap(proc, deadline if said is not None else time.monotonic())
    if said is None:
        raise LaunchFailed(f"{what} did not start in {timeout_s:g}s.", job_id=job_id)
    if said != READY:
        why = f"exited with status {rc}" if rc else "ended"
        raise LaunchFailed(f"{what} {why} before taking the job.", job_id=job_id)


def _readable(fd: int, deadline: float) -> bool:
    """Wait until `fd` is readable (data or EOF), up to `deadline`; poll(2) resumes after a signal (PEP 475)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))


def _reap(proc: subprocess.Popen[bytes], deadline: float) -> int:
    """The first process's exit status, killing it if it has not exited by `deadline`. Once the pipe spoke
    it has forked already, so this is at most its own exit; its pidfd says when, without a polling wait."""
    import subprocess

    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:  # a kernel without pidfds (before 5.3): Popen's own wait, which polls
        try:
            return proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    try:
        if not _readable(pidfd, deadline):
            proc.kill()  # the supervisor, in a session of its own, is not touched by this
    finally:
        os.close(pidfd)
    return proc.wait()


def wake_supervisor(boot_id: str | None, pid: int | None, start_ticks: int | None) -> bool:
    """Tell a job's running supervisor to look at its row now (a cancel was just flagged), instead of at its
    next ledger poll. Only the very process the row recorded is signalled: boot id, pid and start time must
    all match, and it is pinned by a pidfd between the check and the signal. Best effort: whatever goes
    wrong, the supervisor's poll still finds the cancel. True if the signal was sent."""
    if boot_id is None or pid is None or start_ticks is None:
        return False
    from lora_worker.host.processes import Identity, signal_identity  # not before the supervisor's lock

    try:
        return signal_identity(Identity(boot_id, pid, start_ticks), WAKE_SIGNAL)
    except OSError:  # EPERM (another user's process under a reused pid), a kernel without pidfds
        return False


def listen_for_wakeups() -> int:
    """Make WAKE_SIGNAL, SIGCHLD (and any other signal with a Python handler, SIGTERM included) readable on the fd
    returned: the run loop waits on it next to the trainer's pipe. A flag set by a handler would not do:
    select and sleep resume after a handler (PEP 475), so the loop would still wait out its period."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)  # the C-level handler writes a byte per signal; a full pipe drops it
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(WAKE_SIGNAL, _woken)
    # A child's exit wakes the loop too: the launcher's end is seen at once, not when the pause runs out
    # (up to 0.25 s between the trainer's exit and the final state otherwise).
    signal.signal(signal.SIGCHLD, _woken)
    return wake_r


def _woken(_signum: int, _frame: FrameType | None) -> None:
    """Nothing to do here: the byte the interpreter wrote on the wake-up fd is the message."""


class LocalBackend:
    """The detached supervisor on this host, attending the job while it holds the job lock."""

    name = "local"

    def launch(self, job_id: int, settings: Settings) -> None:
        launch_supervisor(job_id, settings)

    def attended(self, job_id: int, settings: Settings) -> bool:
        # The kernel drops the flock when the supervisor dies, zombie or not: no pid is trusted.
        return is_locked(job_lock_path(settings, job_id))


@dataclass
class LaunchOnly(LocalBackend):
    """The local backend with another way to start runs: a test's recorder, a benchmark's counter."""

    start: Launch

    def launch(self, job_id: int, settings: Settings) -> None:
        self.start(job_id, settings)

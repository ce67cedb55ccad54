"""Starting a detached process and waiting for its handshake: the web's end of host/detach.py, used for a
job's supervisor (run/local.py) and the Slurm poller (slurm/process.py) alike.

Nothing heavy at the top: the supervisor imports this module (through run/local.py) before it takes its lock.
"""
from __future__ import annotations

import os
import select
import time
from typing import TYPE_CHECKING

from lora_worker.errors import LaunchFailed
from lora_worker.host.detach import READY, READY_FD_FLAG

if TYPE_CHECKING:
    import subprocess

LAUNCH_TIMEOUT_S = 20.0
SETTINGS_ENV = "LORA_WORKER_SETTINGS"  # the settings, as JSON, that a detached process runs with


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

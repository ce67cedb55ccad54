"""The OS seam: process identity, signals and reaping (the lock files are in `locks`). Everything that touches
/proc or sends a signal is here, so the rest of the supervisor reads as policy. `ProcessHost` bundles what the
run loop uses into one object (the `RunHost` of run/seam.py), so tests can put a recording fake in its place.

A pid alone never identifies a process: the kernel reuses pids. A process is ours only if (boot id, pid, start
time in clock ticks since boot) all match what the ledger recorded, and before a signal the process is pinned
with a pidfd so it cannot be replaced between the check and the kill.
"""
from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psutil

from lora_worker.host import locks

PR_SET_CHILD_SUBREAPER = 36
READ_BYTES = 1 << 16
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class Identity:
    """Who a process is, in a form that survives pid reuse."""

    boot_id: str
    pid: int
    start_ticks: int


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: start time in clock ticks since boot (immune to clock steps)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields resume after the last ')'.
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])


def state_of(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]


def identity_of(pid: int) -> Identity | None:
    ticks = start_ticks(pid)
    return Identity(boot_id(), pid, ticks) if ticks is not None else None


def matches(identity: Identity) -> bool:
    """Whether that very process is alive now (a zombie counts as dead)."""
    if identity.boot_id != boot_id():
        return False
    return start_ticks(identity.pid) == identity.start_ticks and state_of(identity.pid) not in (None, "Z", "X")


def signal_identity(identity: Identity, sig: int) -> bool:
    """Signal the process only if it is still the one recorded; True if the signal was sent."""
    if identity.boot_id != boot_id():
        return False
    try:
        fd = os.pidfd_open(identity.pid)
    except ProcessLookupError:
        return False
    try:
        # Pinned by the pidfd: from here the pid cannot be handed to another process.
        if start_ticks(identity.pid) != identity.start_ticks:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False if it has no members left (ESRCH means already gone)."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) members of a process group."""
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and state_of(pid) not in (None, "Z", "X"):
                members.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def live_descendants(pid: int) -> list[psutil.Process]:
    """Children, grandchildren, … of `pid` that are not zombies (setsid'd ones included)."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    alive = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def kill_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            continue


def set_child_subreaper() -> bool:
    """Make orphaned descendants (a trainer whose launcher died) re-parent to us instead of init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(keep: set[int]) -> None:
    """Reap exited children other than `keep` (Popen reaps its own; reaping it here would hide its status)."""
    # The supervisor calls this on every pass of its loop. Listing children means reading every /proc/<pid>/stat
    # on the host (~1.5 ms), so first ask the kernel, without reaping, whether any child has exited at all.
    try:
        if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return
    except ChildProcessError:
        return  # no children at all
    for proc in psutil.Process().children():
        if proc.pid in keep:
            continue
        try:
            os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:
            continue


def cmdline_contains(pid: int, token: str) -> bool:
    try:
        return token in psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def processes_with_arg(token: str) -> list[int]:
    """Pids of live processes whose argv holds exactly `token`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and token in (proc.info["cmdline"] or ()):
            found.append(proc.pid)
    return found


def signal_name(signum: int) -> str:
    """`SIGKILL`, or `signal 77` for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def split_wait_status(returncode: int | None) -> tuple[int | None, int | None]:
    """Popen's returncode as (exit code, signal number): negative means killed by that signal."""
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, -returncode
    return returncode, None


def decode_wait_status(returncode: int | None) -> str:
    """`exit status 2`, `killed by SIGKILL`, or `no exit status` (still running, or never started)."""
    exit_code, signum = split_wait_status(returncode)
    if signum is not None:
        return f"killed by {signal_name(signum)}"
    return "no exit status" if exit_code is None else f"exit status {exit_code}"


def describe_process(pid: int) -> tuple[str | None, str]:
    """(process name, command line) for display and matching; unreadable processes give (None, "")."""
    try:
        proc = psutil.Process(pid)
        return proc.name(), " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None, ""


class TrainerProcess:
    """The trainer's process group as the run loop sees it: its leader (the launcher) and one merged pipe."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        assert popen.stdout is not None
        self._popen = popen
        self._fd = popen.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._fd, selectors.EVENT_READ)
        self._eof = False

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        return self._popen.poll()

    def read(self, timeout: float) -> bytes | None:
        """What the pipe holds, waiting up to `timeout` for some: b"" if nothing came, None at end of file."""
        if self._eof:
            time.sleep(timeout)  # as a select on no descriptor would: the caller's loop keeps its pace
            return None
        if not self._selector.select(timeout):
            return b""
        try:
            data = os.read(self._fd, READ_BYTES)
        except BlockingIOError:
            return b""
        if not data:
            self._eof = True
            self._selector.unregister(self._fd)
            return None
        return data

    def close(self) -> None:
        self._selector.close()
        self._popen.stdout.close()  # type: ignore[union-attr]


class ProcessHost:
    """Every OS call the run loop makes, in one object, so its rules can be tested against a recording fake
    with a fake clock (tests/run/fake_host.py) instead of real processes."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def identity(self, pid: int | None = None) -> Identity | None:
        return identity_of(os.getpid() if pid is None else pid)

    def become_subreaper(self) -> bool:
        return set_child_subreaper()

    def spawn(self, argv: list[str], *, cwd: Path, env: Mapping[str, str]) -> TrainerProcess:
        """Start the trainer as the leader of a new group; raises OSError if it cannot be started."""
        popen = subprocess.Popen(  # noqa: S603 - argv is the stored list; no shell
            argv, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
            # One pipe for both streams: the kernel keeps the trainer's writes in the order they were made,
            # which two pipes cannot (a "saving checkpoint:" line must follow the redraw before it).
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            umask=0o002,  # outputs readable and writable by the shared group (arbo)
        )
        return TrainerProcess(popen)

    def signal_group(self, pgid: int, sig: int) -> bool:
        return signal_group(pgid, sig)

    def signal_descendants(self, sig: int) -> None:
        """Signal every live descendant of this process: as their subreaper, setsid'd orphans included."""
        kill_all(live_descendants(os.getpid()), sig)

    def group_members(self, pgid: int) -> list[int]:
        return group_members(pgid)

    def descendants(self) -> list[int]:
        return [p.pid for p in live_descendants(os.getpid())]

    def reap_orphans(self, keep: set[int]) -> None:
        reap_orphans(keep)

    def take_lock(self, path: Path, wait_s: float) -> int | None:
        return locks.take_lock(path, wait_s)

    def release_lock(self, fd: int) -> None:
        os.close(fd)  # the kernel drops the flock with its last descriptor

    def on_stop_signals(self, handler: Callable[[int], None]) -> Callable[[], None]:
        """Route SIGTERM and SIGINT to `handler(signum)`; returns what puts the previous handlers back."""
        def received(signum: int, _frame: FrameType | None) -> None:
            handler(signum)

        previous = {s: signal.signal(s, received) for s in STOP_SIGNALS}

        def restore() -> None:
            for s, old in previous.items():
                signal.signal(s, old)
        return restore

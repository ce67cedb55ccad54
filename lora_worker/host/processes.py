"""The OS seam: process identity, signals and reaping (the lock files are in `locks`). Everything that touches
/proc or sends a signal is here, so the rest of the supervisor reads as policy (`process_host` bundles what the
run loop uses into one object).

A pid alone never identifies a process: the kernel reuses pids. A process is ours only if (boot id, pid, start
time in clock ticks since boot) all match what the ledger recorded, and before a signal the process is pinned
with a pidfd so it cannot be replaced between the check and the kill.

What the supervisor calls reads /proc itself (`_pids`, `_stat`); psutil is loaded only by the web's and
reconcile's looks at command lines, so the supervisor, which runs for hours next to the trainer, never
carries it (1.6 MiB and ~5 ms before its trainer starts).
"""
from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Identity:
    """Who a process is, in a form that survives pid reuse."""

    boot_id: str
    pid: int
    start_ticks: int


class OutlivedKill(Exception):
    """Processes that SIGKILL has not ended (yet): one in uninterruptible sleep (state D, in a driver) holds what
    it holds, the GPU included, until it wakes. Whatever they belong to has not ended."""

    def __init__(self, pids: tuple[int, ...], waited_s: float) -> None:
        self.pids, self.waited_s = pids, waited_s
        super().__init__(f"processes {list(pids)} outlived SIGKILL for {waited_s:g} s")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat from field 3 (state) on; None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields resume after the last ')'.
    return stat[stat.rfind(")") + 2:].split()


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: start time in clock ticks since boot (immune to clock steps)."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None else None


def state_of(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0] if fields is not None else None


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


def group_of(pid: int) -> int | None:
    """The process group of `pid`, None once it is gone."""
    fields = _stat(pid)
    return int(fields[2]) if fields is not None else None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) members of a process group."""
    members = []
    for pid in _pids():
        try:
            if os.getpgid(pid) == pgid and state_of(pid) not in (None, "Z", "X"):
                members.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def _children() -> dict[int, list[tuple[int, list[str]]]]:
    """Every process by its parent: ppid -> [(pid, its stat fields)], one read of each /proc/<pid>/stat."""
    tree: dict[int, list[tuple[int, list[str]]]] = {}
    for pid in _pids():
        fields = _stat(pid)
        if fields is not None:
            tree.setdefault(int(fields[1]), []).append((pid, fields))
    return tree


def live_descendants(pid: int) -> list[Identity]:
    """Children, grandchildren, … of `pid` that are not zombies (setsid'd ones included), each as it is now."""
    tree, boot = _children(), boot_id()
    alive, parents = [], [pid]
    while parents:
        for child, fields in tree.get(parents.pop(), ()):
            parents.append(child)
            if fields[0] not in ("Z", "X"):
                alive.append(Identity(boot, child, int(fields[19])))
    return alive


def kill_all(procs: list[Identity], sig: int) -> None:
    """Signal each process that is still the one listed (a pid reused meanwhile is left alone)."""
    for proc in procs:
        signal_identity(proc, sig)


def set_child_subreaper() -> bool:
    """Make orphaned descendants (a trainer whose launcher died) re-parent to us instead of init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
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
    for pid, _fields in _children().get(os.getpid(), ()):
        if pid in keep:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue


def cmdline_contains(pid: int, token: str) -> bool:
    import psutil  # the web's and reconcile's, never the supervisor's

    try:
        return token in psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def processes_with_args(*tokens: str) -> list[int]:
    """Pids of live processes whose argv holds each of `tokens` exactly, as whole arguments."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        argv = proc.info["cmdline"] or ()
        if proc.info["status"] != psutil.STATUS_ZOMBIE and all(token in argv for token in tokens):
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
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.name(), " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None, ""


def pid_namespace(pid: int) -> str | None:
    """The pid namespace a process lives in (`pid:[4026532281]`), None if it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def sandbox_init(launcher_pid: int) -> int | None:
    """The init of the PID namespace a sandbox launcher (bwrap) started: its child in another namespace."""
    own = pid_namespace(launcher_pid)
    children = [pid for pid, _fields in _children().get(launcher_pid, ())]
    return next((pid for pid in children if (ns := pid_namespace(pid)) and ns != own), None)


def namespace_members(namespace: str) -> list[int]:
    """Live processes whose PID namespace is `namespace` (those of a nested one die with it as well)."""
    members = []
    for pid in _pids():
        if pid_namespace(pid) == namespace and state_of(pid) not in (None, "Z", "X"):
            members.append(pid)
    return members

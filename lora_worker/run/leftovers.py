"""What is left of a local job whose supervisor died: found by identity, killed only if provably ours, and
waited for, so that the row is ended only once nothing of the job runs.

Under the sandbox the job is a PID namespace whose init dies with the supervisor, so normally nothing is left.
Its leader (bwrap) may still be alive if the supervisor died in the instant after starting it: then the
namespace's init is killed too, and the kernel takes every process in the namespace with it.

The supervisor writes the trainer's pid to the row only after it started it: one that died in between leaves a
row with no `trainer_pid` and a trainer running. Such a trainer is found by its argv (the job's
`--output_dir=` and `--output_name=`, which the launcher, the trainer and every forked worker carry, and no
other active job can: `one_active_job_per_lora`) among the processes started since the supervisor itself
(`supervisor_start_ticks`, written before the trainer can start).
"""
from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lora_worker.host import processes

# How long SIGKILL is given to take effect before a process that is still there counts as a survivor (one in
# uninterruptible sleep in the driver). A killed process is normally gone in milliseconds; a real trainer
# tearing down its CUDA context may take longer, and is then waited for by the next reconcile.
GONE_WAIT_S = 2.0


class JobProcesses(Protocol):
    """What the row says of the job's processes (the web's ORM row, or any record with these fields)."""

    @property
    def trainer_pid(self) -> int | None: ...
    @property
    def trainer_start_ticks(self) -> int | None: ...
    @property
    def supervisor_start_ticks(self) -> int | None: ...
    @property
    def boot_id(self) -> str | None: ...
    @property
    def argv(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class Leftovers:
    killed: tuple[int, ...]  # alive and signalled: nothing else (a claim of "killed" must be true)
    surviving: tuple[int, ...]  # of those, the ones still alive after GONE_WAIT_S


def kill_leftovers(job: JobProcesses, wait_s: float = GONE_WAIT_S) -> Leftovers:
    """SIGKILL what is left of the job's processes, if and only if they are provably ours, and wait up to
    `wait_s` for them to be gone."""
    if job.boot_id != processes.boot_id():
        return Leftovers((), ())
    token = _arg(job, "--output_dir=")
    if job.trainer_pid:
        killed, since = _recorded_group(job, token), job.trainer_start_ticks or job.supervisor_start_ticks or 0
    elif job.supervisor_start_ticks is not None and token is not None:
        killed, since = [], job.supervisor_start_ticks
    else:
        return Leftovers((), ())  # no supervisor recorded itself: none started a trainer
    if token:
        tokens = [token, *filter(None, [_arg(job, "--output_name=")])]
        killed += _by_argv(tokens, killed, since)
    killed = list(dict.fromkeys(killed))
    return Leftovers(tuple(p.pid for p in killed), tuple(p.pid for p in _wait_gone(killed, wait_s)))


def _arg(job: JobProcesses, prefix: str) -> str | None:
    return next((a for a in job.argv if a.startswith(prefix)), None)


def _recorded_group(job: JobProcesses, token: str | None) -> list[processes.Identity]:
    """The group the row names (its leader is the launcher, or bwrap), killed if it is still ours."""
    assert job.trainer_pid is not None
    leader = processes.Identity(processes.boot_id(), job.trainer_pid, job.trainer_start_ticks or -1)
    members = processes.group_members(job.trainer_pid)
    leader_alive = processes.matches(leader)
    if not (leader_alive or _shows(members, token)):
        return []
    return _kill_group(job.trainer_pid, [*members, *_namespace_of(job.trainer_pid, leader_alive)])


def _kill_group(pgid: int, pids: list[int]) -> list[processes.Identity]:
    killed = [ident for pid in dict.fromkeys(pids) if (ident := _kill(pid))]
    processes.signal_group(pgid, signal.SIGKILL)  # anything forked while we looked
    return killed


def _shows(members: list[int], token: str | None) -> bool:
    """Our output dir is in the trainer's and launcher's argv: a member that shows it is ours even when the
    group's leader (the launcher) is gone. A reused pid cannot lead a group while our group still exists."""
    return token is not None and any(processes.cmdline_contains(pid, token) for pid in members)


def _namespace_of(leader: int, leader_alive: bool) -> list[int]:
    """Every process in the sandbox's PID namespace, while its leader lives."""
    namespace_init = processes.sandbox_init(leader) if leader_alive else None
    namespace = processes.pid_namespace(namespace_init) if namespace_init else None
    return processes.namespace_members(namespace) if namespace else []


def _by_argv(tokens: list[str], killed: list[processes.Identity], started: int) -> list[processes.Identity]:
    """The job's processes the recorded group does not hold: all of them when no group was recorded, else a
    grandchild that started its own session. Each is ours by its argv and its start (not before `started`);
    one that leads its group takes the group and its sandbox's namespace with it. (One that re-exec'd itself
    under another name outside the sandbox cannot be seen here; the sandbox's namespace catches it.)"""
    found: list[processes.Identity] = []
    for pid in processes.processes_with_args(*tokens):
        ident = processes.identity_of(pid)
        if ident is None or ident.start_ticks < started or any(p.pid == pid for p in [*killed, *found]):
            continue
        if processes.group_of(pid) == pid:  # its members and namespace listed before the leader goes
            found += _kill_group(pid, [pid, *processes.group_members(pid), *_namespace_of(pid, True)])
        elif processes.signal_identity(ident, signal.SIGKILL):
            found.append(ident)
    return found


def _kill(pid: int) -> processes.Identity | None:
    ident = processes.identity_of(pid)
    return ident if ident is not None and processes.signal_identity(ident, signal.SIGKILL) else None


def _wait_gone(killed: list[processes.Identity], wait_s: float) -> list[processes.Identity]:
    """Those of `killed` still alive after `wait_s` (SIGKILL takes effect when the process next runs)."""
    deadline = time.monotonic() + wait_s
    while (alive := [p for p in dict.fromkeys(killed) if processes.matches(p)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive

"""What is left of a local job whose supervisor died: found by identity, killed only if provably ours.

Under the sandbox the job is a PID namespace whose init dies with the supervisor, so normally nothing is left.
Its leader (bwrap) may still be alive if the supervisor died in the instant after starting it: then the
namespace's init is killed too, and the kernel takes every process in the namespace with it.
"""
from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Protocol

from lora_worker.host import processes


class JobProcesses(Protocol):
    """What the row says of the job's processes (the web's ORM row, or any record with these fields)."""

    @property
    def trainer_pid(self) -> int | None: ...
    @property
    def trainer_start_ticks(self) -> int | None: ...
    @property
    def boot_id(self) -> str | None: ...
    @property
    def argv(self) -> Sequence[str]: ...


def kill_leftovers(job: JobProcesses) -> list[int]:
    """SIGKILL what is left of the job's processes, if and only if they are provably ours; returns the pids
    that were alive and got the signal (nothing else: a claim of "killed" must be true)."""
    if not job.trainer_pid or job.boot_id != processes.boot_id():
        return []
    leader = processes.Identity(job.boot_id, job.trainer_pid, job.trainer_start_ticks or -1)
    token = next((a for a in job.argv if a.startswith("--output_dir=")), None)
    members = processes.group_members(job.trainer_pid)
    leader_alive = processes.matches(leader)
    if not (leader_alive or _shows(members, token)):
        return []
    killed = [pid for pid in dict.fromkeys([*members, *_namespace_of(job.trainer_pid, leader_alive)]) if _kill(pid)]
    processes.signal_group(job.trainer_pid, signal.SIGKILL)  # anything forked while we looked
    return killed + (_escaped(token, killed, job.trainer_start_ticks or 0) if token else [])


def _shows(members: list[int], token: str | None) -> bool:
    """Our output dir is in the trainer's and launcher's argv: a member that shows it is ours even when the
    group's leader (the launcher) is gone. A reused pid cannot lead a group while our group still exists."""
    return token is not None and any(processes.cmdline_contains(pid, token) for pid in members)


def _namespace_of(leader: int, leader_alive: bool) -> list[int]:
    """Every process in the sandbox's PID namespace, while its leader lives."""
    namespace_init = processes.sandbox_init(leader) if leader_alive else None
    namespace = processes.pid_namespace(namespace_init) if namespace_init else None
    return processes.namespace_members(namespace) if namespace else []


def _escaped(token: str, killed: list[int], started: int) -> list[int]:
    """Without the sandbox, a grandchild that started its own session escaped the group; its argv may still
    name our output dir (one that re-exec'd itself under another name is only caught by the sandbox)."""
    found = []
    for pid in processes.processes_with_arg(token):
        if pid in killed:
            continue
        ident = processes.identity_of(pid)
        if ident is not None and ident.start_ticks >= started and processes.signal_identity(ident, signal.SIGKILL):
            found.append(pid)
    return found


def _kill(pid: int) -> bool:
    ident = processes.identity_of(pid)
    return ident is not None and processes.signal_identity(ident, signal.SIGKILL)

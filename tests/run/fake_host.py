"""A recording fake of the run loop's host (lora_worker.run.seam.RunHost), with a fake clock: no fork.

`FakeHost` keeps time (it passes only when the loop sleeps or waits on the pipe), records every signal, lock
and process death with the time it happened, and fires scheduled actions (`at`) as time passes.
`FakeJob` is the trainer's process tree as the host would show it: the launcher (leader of the group, its exit
status is the run's), the trainer, and optionally a grandchild in its own session, each holding the one pipe
until it dies. Each process reacts to signals as told: SIGTERM ends it after `term_delay_s` unless it ignores
SIGTERM; SIGKILL ends it at once unless it is stuck in the kernel until `unkillable_until`.
"""
from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lora_worker.host.processes import Identity
from lora_worker.ledger.supervisor import JobRecord

READ_BYTES = 1 << 16
LAUNCHER_PID = 4200
SUPERVISOR_PID = 4100


@dataclass
class FakeProcess:
    pid: int
    in_group: bool = True
    holds_pipe: bool = True  # False: it closed its stdout (a daemon), so the pipe's EOF says nothing of it
    ignores_term: bool = False
    term_delay_s: float = 0.1
    unkillable_until: float = 0.0
    alive: bool = True
    dying_at: float | None = None


@dataclass
class Event:
    at: float
    kind: str
    detail: tuple[object, ...] = ()


class FakeHost:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.events: list[Event] = []
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.job: FakeJob | None = None
        self.spawn_error: OSError | None = None
        self.moved: str | None = None  # what the pre-exec check finds changed since dispatch (None: nothing)
        self.lock_wait_s = 0.0  # how long taking a lock takes (another holder letting go)
        self.locks_refused: set[str] = set()
        self.locks: dict[int, str] = {}
        self.signal_handler: Callable[[int], None] | None = None
        self.wake_pending = False  # a byte on the wake-up pipe: a signal came (the web's cancel, SIGTERM)
        self._next_fd = 10
        self._seq = 0

    # -- the test's side ---------------------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Do `action` once the clock reaches `when` (seconds after the start)."""
        self._seq += 1
        self.timers.append((when, self._seq, action))
        self.timers.sort(key=lambda t: (t[0], t[1]))

    def record(self, kind: str, *detail: object) -> None:
        self.events.append(Event(self.now, kind, detail))

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    def signals(self, sig: int) -> list[Event]:
        return [e for e in self.events if e.kind == "signal_group" and e.detail[1] == sig]

    def first(self, kind: str, *detail: object) -> Event:
        return next(e for e in self.events if e.kind == kind and e.detail[:len(detail)] == detail)

    def deliver(self, signum: int) -> None:
        """The supervisor receives `signum` (systemd stopping the unit): its handler runs, and, as with the
        real wake-up fd, the interpreter writes a byte to the wake-up pipe."""
        assert self.signal_handler is not None, "no handler installed"
        self.signal_handler(signum)
        self.wake()

    def wake(self) -> None:
        """The wake-up signal arrives (the web's cancel): the pipe the loop waits on becomes readable."""
        self.record("wake")
        self.wake_pending = True

    def advance(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """Let `seconds` pass, firing what falls due; stop early once `until()` holds."""
        end = self.now + seconds
        while self.timers and self.timers[0][0] <= end:
            when, _, action = self.timers.pop(0)
            self.now = max(self.now, when)
            action()
            if until is not None and until():
                return
        self.now = end

    # -- RunHost -----------------------------------------------------------------------------------------

    def monotonic(self) -> float:
        return self.now

    def wall_time(self) -> float:
        return 1.7e9 + self.now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def pause(self, seconds: float) -> None:
        if not self.wake_pending:  # a pending byte makes the real select return at once
            self.advance(seconds, until=lambda: self.wake_pending)

    def woken(self) -> bool:
        got, self.wake_pending = self.wake_pending, False
        return got

    def identity(self, pid: int | None = None) -> Identity | None:
        return Identity("fake-boot", SUPERVISOR_PID if pid is None else pid, 777)

    def become_subreaper(self) -> bool:
        self.record("subreaper")
        return True

    def what_moved(self, job: object) -> str | None:
        self.record("what_moved")
        return self.moved

    def command_for(self, job: JobRecord, settings: object) -> list[str]:
        return list(job.argv)  # the sandbox's own command is tested on the real OS (tests/host/test_sandbox.py)

    def spawn(self, argv: list[str], *, cwd: Path, env: Mapping[str, str]) -> FakeJob:
        self.record("spawn", tuple(argv))
        if self.spawn_error is not None:
            raise self.spawn_error
        assert self.job is not None, "the test gives the host a FakeJob to start"
        self.job.started(self)
        return self.job

    def signal_group(self, pgid: int, sig: int) -> bool:
        self.record("signal_group", pgid, sig)
        assert self.job is not None
        members = [p for p in self.job.processes if p.alive and p.in_group]
        for proc in members:
            self.job.signal(proc, sig)
        return bool(members)

    def signal_descendants(self, sig: int) -> None:
        self.record("signal_descendants", sig)
        if self.job is not None:
            for proc in self.job.processes:
                if proc.alive:
                    self.job.signal(proc, sig)

    def group_members(self, pgid: int) -> list[int]:
        return [] if self.job is None else [p.pid for p in self.job.processes if p.alive and p.in_group]

    def descendants(self) -> list[int]:
        return [] if self.job is None else [p.pid for p in self.job.processes if p.alive]

    def reap_orphans(self, keep: set[int]) -> None:
        pass  # the fake leaves no zombies

    def take_lock(self, path: Path, wait_s: float) -> int | None:
        self.advance(min(self.lock_wait_s, wait_s))
        if path.name in self.locks_refused:
            self.record("lock_refused", path.name)
            return None
        self._next_fd += 1
        self.locks[self._next_fd] = path.name
        self.record("take_lock", path.name)
        return self._next_fd

    def hold(self, name: str) -> int:
        """A lock the test took for the supervisor (the job lock, taken before the run loop starts)."""
        self._next_fd += 1
        self.locks[self._next_fd] = name
        return self._next_fd

    def release_lock(self, fd: int) -> None:
        self.record("release_lock", self.locks.pop(fd))

    def on_stop_signals(self, handler: Callable[[int], None]) -> Callable[[], None]:
        self.signal_handler = handler

        def restore() -> None:
            self.signal_handler = None
        return restore


@dataclass
class FakeJob:
    """The launcher → trainer (→ grandchild) tree, and the pipe they share. Output is scheduled with `say`,
    endings with `exit`, both in seconds after the spawn."""

    launcher: FakeProcess = field(default_factory=lambda: FakeProcess(LAUNCHER_PID))
    trainer: FakeProcess = field(default_factory=lambda: FakeProcess(LAUNCHER_PID + 1))
    grandchild: FakeProcess | None = None
    script: list[tuple[float, Callable[[FakeJob], None]]] = field(default_factory=list)
    pipe: bytearray = field(default_factory=bytearray)
    returncode: int | None = None
    host: FakeHost | None = None
    spawned_at: float = 0.0
    _eof: bool = False

    @property
    def processes(self) -> list[FakeProcess]:
        return [self.launcher, self.trainer] + ([self.grandchild] if self.grandchild else [])

    @property
    def pid(self) -> int:
        return self.launcher.pid

    def say(self, after_s: float, text: str | bytes) -> FakeJob:
        data = text.encode() if isinstance(text, str) else text
        self.script.append((after_s, lambda job: job.pipe.extend(data)))
        return self

    def exit(self, after_s: float, rc: int) -> FakeJob:
        """The trainer ends on its own with `rc`; the launcher reports it and exits with it."""
        def end(job: FakeJob) -> None:
            for proc in (job.trainer, job.launcher):
                job.die(proc, rc)
        self.script.append((after_s, end))
        return self

    def kill_launcher(self, after_s: float, sig: int) -> FakeJob:
        """The launcher alone is killed (the OOM killer, an operator): the trainer runs on, holding the pipe."""
        self.script.append((after_s, lambda job: job.die(job.launcher, -sig)))
        return self

    def started(self, host: FakeHost) -> None:
        self.host, self.spawned_at = host, host.now
        for after_s, action in self.script:
            host.at(host.now + after_s, lambda action=action: action(self))

    def signal(self, proc: FakeProcess, sig: int) -> None:
        assert self.host is not None
        if sig == signal.SIGKILL:
            if self.host.now >= proc.unkillable_until:
                self.die(proc, -signal.SIGKILL)
            elif proc.dying_at is None:
                proc.dying_at = proc.unkillable_until
                self.host.at(proc.unkillable_until, lambda: self.die(proc, -signal.SIGKILL))
        elif sig == signal.SIGTERM and not proc.ignores_term and proc.dying_at is None:
            proc.dying_at = self.host.now + proc.term_delay_s
            self.host.at(proc.dying_at, lambda: self.die(proc, -signal.SIGTERM))

    def die(self, proc: FakeProcess, rc: int) -> None:
        assert self.host is not None
        if not proc.alive:
            return
        proc.alive = False
        self.host.record("died", proc.pid, rc)
        if proc is self.launcher:
            self.returncode = rc
        if not any(p.alive for p in self.processes):
            self.host.record("all_gone")

    # -- Trainer -----------------------------------------------------------------------------------------

    def poll(self) -> int | None:
        return self.returncode

    def read(self, timeout: float) -> bytes | None:
        assert self.host is not None
        if self._eof:
            host = self.host
            if not host.wake_pending:
                host.advance(timeout, until=lambda: host.wake_pending)
            return None
        if not self.pipe and self._pipe_open() and not self.host.wake_pending:
            # As the real read's select: output, the end of the pipe, or a wake-up ends the wait.
            host = self.host
            host.advance(timeout, until=lambda: bool(self.pipe) or not self._pipe_open() or host.wake_pending)
        if self.pipe:
            data = bytes(self.pipe[:READ_BYTES])
            del self.pipe[:READ_BYTES]
            return data
        if not self._pipe_open():
            self._eof = True
            return None
        return b""

    def close(self) -> None:
        assert self.host is not None
        self.host.record("pipe_closed")

    def _pipe_open(self) -> bool:
        return any(p.alive and p.holds_pipe for p in self.processes)

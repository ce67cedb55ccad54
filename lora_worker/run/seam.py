"""What the run loop needs of the operating system, as two protocols.

`SupervisorHost` below is the real one: `lora_worker.host.process_host.ProcessHost` (processes, signals, locks,
clocks) plus the two looks at the job's files before exec (the pre-exec check, the sandboxed command). The
loop's rules (cancel → TERM → grace → KILL, the stall watchdog, the orphaned launcher, a busy ledger, the order of
the final writes) are unit-tested against a recording fake with a fake clock (tests/run/fake_host.py): nothing
here may reach the OS any other way.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from lora_worker.host import sandbox
from lora_worker.host.process_host import ProcessHost, TrainerProcess
from lora_worker.host.processes import Identity
from lora_worker.ledger.supervisor import JobRecord
from lora_worker.config import Settings
from lora_worker.run.prelaunch import Checked, check


class Trainer(Protocol):
    """The started trainer: the leader of its process group (the launcher) and the one pipe it writes to."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def read(self, timeout: float) -> bytes | None:
        """Output, waiting up to `timeout` for some: b"" if none came, None once the pipe is at end of file."""

    def close(self) -> None: ...


class RunHost(Protocol):
    """Clocks, the trainer's processes, signals and lock files."""

    def monotonic(self) -> float: ...

    def wall_time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    def pause(self, seconds: float) -> None:
        """The loop's wait between passes: `seconds`, or less once a wake-up is pending (a cancel's signal)."""

    def woken(self) -> bool:
        """Whether a wake-up came since the last call (the trainer's `read` also ends early on one)."""

    def identity(self, pid: int | None = None) -> Identity | None:
        """Who `pid` (default: this process) is, in a form that survives pid reuse."""

    def become_subreaper(self) -> bool: ...

    def what_moved(self, job: JobRecord) -> str | None:
        """Why the trainer must not start (a directory swapped, a link planted since the check), or None."""

    def command_for(self, job: JobRecord, settings: Settings) -> list[str]:
        """The stored argv as it runs: inside the job's sandbox, or as it is with sandbox = "none"."""

    def spawn(self, argv: list[str], *, cwd: Path, env: Mapping[str, str]) -> Trainer:
        """Start the trainer in a new process group; OSError if it cannot start."""

    def signal_group(self, pgid: int, sig: int) -> bool: ...

    def signal_descendants(self, sig: int) -> None: ...

    def group_members(self, pgid: int) -> list[int]: ...

    def descendants(self) -> list[int]: ...

    def reap_orphans(self, keep: set[int]) -> None: ...

    def take_lock(self, path: Path, wait_s: float) -> int | None: ...

    def release_lock(self, fd: int) -> None: ...

    def on_stop_signals(self, handler: Callable[[int], None]) -> Callable[[], None]:
        """Route SIGTERM, SIGINT and SIGHUP to `handler`; returns what restores the previous handlers."""


class SupervisorHost(ProcessHost):
    """The real RunHost: the OS seam, and the job's files looked at once more right before exec.

    The directories that last look opened stay open until the trainer has started: the sandbox binds those
    descriptors (inherited by bwrap, then closed here), never the paths again."""

    def __init__(self, wake_fd: int | None = None) -> None:
        super().__init__(wake_fd)
        self._checked: Checked | None = None

    def what_moved(self, job: JobRecord) -> str | None:
        self._release()
        checked = check(job)
        self._checked = checked if checked.moved is None else None
        return checked.moved

    def command_for(self, job: JobRecord, settings: Settings) -> list[str]:
        paths = sandbox.JobPaths(Path(job.dataset_dir), Path(job.base_model_path), Path(job.output_dir),
                                 read_only=sandbox.argv_files(job.argv))
        if settings.sandbox == sandbox.NONE:
            self._release()  # nothing binds them: the trainer opens its paths itself, and inherits no fd
        held = self._checked.held if self._checked is not None else {}
        try:
            return sandbox.wrap(job.argv, paths, settings, sandbox.host_facts(settings), held)
        except ValueError as exc:  # refused (a bind too wide, nothing checked): the trainer is not started
            self._release()
            raise OSError(f"the sandbox refuses to start: {exc}") from exc

    def spawn(self, argv: list[str], *, cwd: Path, env: Mapping[str, str],
              pass_fds: tuple[int, ...] = ()) -> TrainerProcess:
        held = tuple(self._checked.held.values()) if self._checked is not None else ()
        try:
            return super().spawn(argv, cwd=cwd, env=env, pass_fds=pass_fds + held)
        finally:
            self._release()  # bwrap has its own copies now (or never started)

    def _release(self) -> None:
        if self._checked is not None:
            self._checked.close()
            self._checked = None

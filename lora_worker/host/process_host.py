"""The OS as the run loop uses it, in one object: `ProcessHost` is the `RunHost` of run/seam.py, so the loop's
rules can be tested against a recording fake with a fake clock (tests/run/fake_host.py) instead of real
processes. `TrainerProcess` is the started trainer: the leader of its group and the one pipe it writes to."""
from __future__ import annotations

import fcntl
import os
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

from lora_worker.host import locks, processes

READ_BYTES = 1 << 16  # per read() call: larger reads were measured slower than 64 KiB ones
PIPE_BYTES = 1 << 20  # the trainer's pipe, enlarged: a flood waits there while a chunk is parsed
DRAIN_BYTES = 1 << 18  # the most one `read` returns: a quarter of the enlarged pipe (peak RSS: see below)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # run/stopper.py StopReason.SIGNAL


class TrainerProcess:
    """The trainer's process group as the run loop sees it: its leader (the launcher) and one merged pipe."""

    def __init__(self, popen: subprocess.Popen[bytes], wake_fd: int | None = None) -> None:
        assert popen.stdout is not None
        self._popen = popen
        self._fd = popen.stdout.fileno()
        os.set_blocking(self._fd, False)
        enlarge_pipe(self._fd, PIPE_BYTES)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._fd, selectors.EVENT_READ)
        self._wake = [] if wake_fd is None else [wake_fd]
        if wake_fd is not None:
            # A wake-up ends the wait for output too (read then finds nothing and says b""): the loop goes
            # on to look at the ledger at once. The host's `woken` drains it.
            self._selector.register(wake_fd, selectors.EVENT_READ)
        self._buffer = memoryview(bytearray(DRAIN_BYTES))  # reused: no allocation, no page faults per read
        self._at_eof = False  # read() returned 0: the pipe is at end of file
        self._eof = False  # ... and the caller has been told

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        return self._popen.poll()

    def read(self, timeout: float) -> bytes | None:
        """What the pipe holds, waiting up to `timeout` for some: b"" if nothing came, None at end of file.

        A flood is taken in one call, up to DRAIN_BYTES, in reads of READ_BYTES: one pass of the caller's loop
        per pipeful instead of one per 64 KiB."""
        if self._at_eof:
            if not self._eof:
                self._eof = True
                return None
            select.select(self._wake, [], [], timeout)  # the caller's loop keeps its pace, a wake-up ends it
            return None
        if not self._selector.select(timeout):
            return b""
        filled = 0
        while filled < DRAIN_BYTES:
            try:
                n = os.readv(self._fd, [self._buffer[filled:filled + READ_BYTES]])
            except BlockingIOError:
                break
            if n == 0:
                self._at_eof = True
                self._selector.unregister(self._fd)
                break
            filled += n
            if n < READ_BYTES:
                break  # a short read: the pipe is empty now
        if filled == 0 and self._at_eof:
            self._eof = True
            return None
        return bytes(self._buffer[:filled])

    def close(self) -> None:
        self._selector.close()
        self._popen.stdout.close()  # type: ignore[union-attr]


def enlarge_pipe(fd: int, size: int) -> int | None:
    """Ask the kernel for a pipe of `size` bytes; the size granted, or None where it refuses (the per-user
    pipe limit, an old kernel): a smaller pipe only means more passes, never lost output."""
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except (OSError, AttributeError):
        return None


class ProcessHost:
    """Every OS call the run loop makes, in one object, so its rules can be tested against a recording fake
    with a fake clock (tests/run/fake_host.py) instead of real processes.

    `wake_fd` is the read end of the wake-up pipe (run/local.py `listen_for_wakeups`): readable once a signal
    came. The loop's waits (`pause`, and the trainer's `read`) end on it; without one they wait their time."""

    def __init__(self, wake_fd: int | None = None) -> None:
        self.wake_fd = wake_fd

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if a wake-up is pending or comes meanwhile (it is left for `woken`)."""
        if self.wake_fd is None:
            time.sleep(seconds)
        else:
            select.select([self.wake_fd], [], [], seconds)

    def woken(self) -> bool:
        """Whether a wake-up came since the last call; takes it off the pipe."""
        if self.wake_fd is None:
            return False
        got = False
        while True:
            try:
                data = os.read(self.wake_fd, 64)
            except BlockingIOError:
                return got
            if not data:
                return got
            got = True

    def identity(self, pid: int | None = None) -> processes.Identity | None:
        return processes.identity_of(os.getpid() if pid is None else pid)

    def become_subreaper(self) -> bool:
        return processes.set_child_subreaper()

    def spawn(self, argv: list[str], *, cwd: Path, env: Mapping[str, str],
              pass_fds: tuple[int, ...] = ()) -> TrainerProcess:
        """Start the trainer as the leader of a new group; raises OSError if it cannot be started. `pass_fds`
        are inherited (the checked directories the sandbox binds); every other descriptor is closed."""
        popen = subprocess.Popen(  # noqa: S603 - argv is the stored list; no shell
            argv, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, pass_fds=pass_fds,
            # One pipe for both streams: the kernel keeps the trainer's writes in the order they were made,
            # which two pipes cannot (a "saving checkpoint:" line must follow the redraw before it).
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            umask=0o002,  # outputs readable and writable by the shared group (arbo)
        )
        return TrainerProcess(popen, self.wake_fd)

    def signal_group(self, pgid: int, sig: int) -> bool:
        return processes.signal_group(pgid, sig)

    def signal_descendants(self, sig: int) -> None:
        """Signal every live descendant of this process: as their subreaper, setsid'd orphans included."""
        processes.kill_all(processes.live_descendants(os.getpid()), sig)

    def group_members(self, pgid: int) -> list[int]:
        return processes.group_members(pgid)

    def descendants(self) -> list[int]:
        return [p.pid for p in processes.live_descendants(os.getpid())]

    def reap_orphans(self, keep: set[int]) -> None:
        processes.reap_orphans(keep)

    def take_lock(self, path: Path, wait_s: float) -> int | None:
        return locks.take_lock(path, wait_s)

    def release_lock(self, fd: int) -> None:
        os.close(fd)  # the kernel drops the flock with its last descriptor

    def on_stop_signals(self, handler: Callable[[int], None]) -> Callable[[], None]:
        """Route SIGTERM, SIGINT and SIGHUP to `handler(signum)`; returns what puts the previous handlers back."""
        def received(signum: int, _frame: FrameType | None) -> None:
            handler(signum)

        previous = {s: signal.signal(s, received) for s in STOP_SIGNALS}

        def restore() -> None:
            for s, old in previous.items():
                signal.signal(s, old)
        return restore

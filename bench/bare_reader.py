"""The stream benchmark's baseline: start a command and read both its pipes to the end, discarding the bytes.

The same pipe and loop shape as the supervisor's (host/process_host.py `TrainerProcess.read`, driven by
run/runner.py `JobRun._supervise`): stdout and stderr merged into one pipe, enlarged to 1 MiB, a selector on
it, reads of 64 KiB into one reused buffer until the pipe is empty (1 MiB at most per wake-up), a 0.2 s select
timeout. Nothing is copied out of the buffer, decoded, parsed, logged or written, and it never pauses to let
output gather: the floor any reader of the pipe pays. It leaves as the supervisor does, by `os._exit` (no
interpreter teardown: issue #22 found the old baseline paying one the supervisor skips, which flattered the
ratio).
Usage: python bench/bare_reader.py <command> [args…]
"""
from __future__ import annotations

import fcntl
import os
import selectors
import subprocess
import sys

READ_BYTES = 1 << 16
DRAIN_BYTES = 1 << 20
SELECT_TIMEOUT_S = 0.2


def main(argv: list[str]) -> int:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    selector = selectors.DefaultSelector()
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, DRAIN_BYTES)
    except OSError:
        pass
    selector.register(fd, selectors.EVENT_READ)
    buffer = memoryview(bytearray(DRAIN_BYTES))
    open_pipes = 1
    while open_pipes or proc.poll() is None:
        for key, _ in selector.select(SELECT_TIMEOUT_S):
            filled = 0
            while filled < DRAIN_BYTES:
                try:
                    n = os.readv(key.fd, [buffer[filled:filled + READ_BYTES]])
                except BlockingIOError:
                    break
                if n == 0:
                    selector.unregister(key.fd)
                    open_pipes -= 1
                    break
                filled += n
                if n < READ_BYTES:
                    break
    return proc.wait()


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(status)  # as run/main.py leaves: the same work as the supervisor, and no more

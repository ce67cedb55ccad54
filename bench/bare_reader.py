"""The stream benchmark's baseline: start a command and read both its pipes to the end, discarding the bytes.

The same pipe and loop shape as the supervisor's (host/process_host.py `TrainerProcess.read`, driven by
run/runner.py `JobRun._supervise`): stdout and stderr merged into one pipe, a selector on it, `os.read` of
64 KiB, a 0.2 s select timeout. Nothing is decoded, parsed,
logged or written, and it never pauses to let output gather.
Usage: python bench/bare_reader.py <command> [args…]
"""
from __future__ import annotations

import os
import selectors
import subprocess
import sys

READ_BYTES = 1 << 16
SELECT_TIMEOUT_S = 0.2


def main(argv: list[str]) -> int:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    selector = selectors.DefaultSelector()
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    selector.register(proc.stdout.fileno(), selectors.EVENT_READ)
    open_pipes = 1
    while open_pipes or proc.poll() is None:
        for key, _ in selector.select(SELECT_TIMEOUT_S):
            try:
                data = os.read(key.fd, READ_BYTES)
            except BlockingIOError:
                continue
            if not data:
                selector.unregister(key.fd)
                open_pipes -= 1
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A process that reports each wake-up signal it receives (the supervisor's wake-up, seen from outside)."""
from __future__ import annotations

import select
import subprocess
import sys

import pytest

LISTENER = r"""
import signal, sys, time
signal.signal(signal.SIGURG, lambda *a: (sys.stdout.write("woken\n"), sys.stdout.flush()))
print("listening", flush=True)
time.sleep(30)
"""


@pytest.fixture
def listener():
    """A process that says "woken" on each wake-up signal it receives."""
    proc = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "listening\n"
    with proc:  # closes its stdout
        yield proc
        proc.kill()


def heard(proc: subprocess.Popen[str], within: float = 0.3) -> bool:
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], within)[0]:
        return False
    assert proc.stdout.readline() == "woken\n"
    return True


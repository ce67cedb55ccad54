"""A process that reports each wake-up signal it receives (the supervisor's wake-up, seen from outside)."""
from __future__ import annotations

import select
import subprocess
import sys

LISTENER = r"""
import signal, sys, time
signal.signal(signal.SIGURG, lambda *a: (sys.stdout.write("woken\n"), sys.stdout.flush()))
print("listening", flush=True)
time.sleep(30)
"""


def start_listener() -> subprocess.Popen[str]:
    """A process that says "woken" on each wake-up signal it receives (the `listener` fixture of
    tests/conftest.py)."""
    proc = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "listening\n"
    return proc


def heard(proc: subprocess.Popen[str], within: float = 0.3) -> bool:
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], within)[0]:
        return False
    assert proc.stdout.readline() == "woken\n"
    return True


"""The real supervisor, SIGKILLed right after it started the trainer and before the trainer's pid reached the
ledger: a row with no `trainer_pid` while the launcher, the trainer and its forked worker run on.

It dies once the trainer has written its record (RECORD=<path> in the environment: the fake trainer's
`record` mode), so the whole tree is up, a grandchild included, when the supervisor goes.
Usage: python -m tests.chaos.killed_after_spawn <job_id>, started as tests/chaos/test_kill_points.py does.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from lora_worker.host import process_host

RECORD = Path(os.environ["RECORD"])
_spawn = process_host.ProcessHost.spawn


def _spawn_then_die(self, argv, **kwargs):  # type: ignore[no-untyped-def]
    trainer = _spawn(self, argv, **kwargs)
    deadline = time.monotonic() + 30
    while not RECORD.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
    return trainer


process_host.ProcessHost.spawn = _spawn_then_die  # type: ignore[method-assign]

from lora_worker.run.__main__ import main  # noqa: E402 - after the patch, on purpose

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

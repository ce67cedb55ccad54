"""`python -m lora_worker.run <job_id> [--ready-fd=N]`: become the job's detached supervisor.

Started by the web process in a new session; host/detach.py forks it off and says how the ready byte (written
once the supervisor holds the job lock) reaches whoever started it. Only `os` and `sys` are imported before
the fork. The web's POST /train waits for that byte, so when the web names the job's lock file
(JOB_LOCK_ENV) the lock is taken right after the fork, with host/flock.py alone: settings, logging and the
rest of the worker are imported once the POST is answered. Started by hand, the lock is found from the
settings (run/main.py).
"""
from __future__ import annotations

import os
import sys

from lora_worker.host.detach import JOB_LOCK_ENV, LOCK_WAIT_S, READY, detach, ready_fd_arg

USAGE = "usage: python -m lora_worker.run <job_id> [--ready-fd=N]"


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or not argv[0].isdigit() or (len(argv) == 2 and ready_fd_arg(argv[1]) is None):
        print(USAGE, file=sys.stderr)
        return 2
    status, ready_w = detach(ready_fd_arg(argv[1]) if len(argv) == 2 else None)
    if status is not None:
        return status
    lock_fd = None
    if lock_path := os.environ.pop(JOB_LOCK_ENV, None):
        from lora_worker.host.flock import take_lock

        lock_fd = take_lock(lock_path, LOCK_WAIT_S)
        if lock_fd is None:
            print(f"job {argv[0]}: another supervisor holds the job lock {lock_path}", file=sys.stderr)
            return 1  # the ready pipe closes unwritten: the web's launch fails at once
        os.write(ready_w, READY)
        os.close(ready_w)
        ready_w = -1
    from lora_worker.run.main import serve

    return serve(int(argv[0]), ready_w, lock_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

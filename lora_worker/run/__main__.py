"""`python -m lora_worker.run <job_id>`: become the job's detached supervisor.

Started by the web process in a new session. It forks once more: the first process waits until the real
supervisor holds the job lock, then exits, so the web reaps it at once and never keeps a zombie; the real
supervisor is re-parented to init (or the unit's subreaper) and lives on. Only `os` and `sys` are imported
before the fork.
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m lora_worker.run <job_id>", file=sys.stderr)
        return 2
    job_id = int(argv[0])
    ready_r, ready_w = os.pipe()
    if os.fork():
        os.close(ready_w)
        ok = os.read(ready_r, 1) == b"1"  # EOF (b"") if the supervisor died before taking its lock
        return 0 if ok else 1
    os.close(ready_r)
    os.setsid()  # leader of its own session and group: signals aimed at the launcher's group miss it
    from lora_worker.run.main import serve

    return serve(job_id, ready_w)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

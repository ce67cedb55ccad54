"""`python -m lora_worker.run <job_id> [--ready-fd=N]`: become the job's detached supervisor.

Started by the web process in a new session; run/detach.py forks it off and says how the ready byte (written
once the supervisor holds the job lock) reaches whoever started it. Only `os` and `sys` are imported before
the fork.
"""
from __future__ import annotations

import sys

from lora_worker.run.detach import detach, ready_fd_arg

USAGE = "usage: python -m lora_worker.run <job_id> [--ready-fd=N]"


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or not argv[0].isdigit() or (len(argv) == 2 and ready_fd_arg(argv[1]) is None):
        print(USAGE, file=sys.stderr)
        return 2
    status, ready_w = detach(ready_fd_arg(argv[1]) if len(argv) == 2 else None)
    if status is not None:
        return status
    from lora_worker.run.main import serve

    return serve(int(argv[0]), ready_w)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m lora_worker.slurm [--ready-fd=N]`: become the worker's Slurm poller (process.py says what
it is). Forked off as a job's supervisor is (host/detach.py); only `os` and `sys` come before the fork.
"""
from __future__ import annotations

import sys

from lora_worker.host.detach import detach, ready_fd_arg

USAGE = "usage: python -m lora_worker.slurm [--ready-fd=N]"


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and ready_fd_arg(argv[0]) is None):
        print(USAGE, file=sys.stderr)
        return 2
    status, ready_w = detach(ready_fd_arg(argv[0]) if argv else None)
    if status is not None:
        return status
    from lora_worker.slurm.process import serve

    return serve(ready_w)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

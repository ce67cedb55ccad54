"""`python -m lora_worker.slurm [--ready-fd=N]`: become the worker's Slurm poller (process.py says what
it is). Forked off as a job's supervisor is (host/detach.py); only `os` and `sys` come before the fork.
"""
from __future__ import annotations

import sys

from lora_worker.host.detach import detached_main

USAGE = "usage: python -m lora_worker.slurm [--ready-fd=N]"


def main(argv: list[str]) -> int:
    return detached_main(argv, USAGE, "lora_worker.slurm.process")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

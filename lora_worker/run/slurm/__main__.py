"""`python -m lora_worker.run.slurm`: become the worker's Slurm poller (process.py says what it is).

As the supervisor's entry point: it forks once more; the first process waits until the poller holds its lock
(or exits without it), then exits, so whoever started it reaps it at once; the poller lives on, re-parented.
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python -m lora_worker.run.slurm", file=sys.stderr)
        return 2
    ready_r, ready_w = os.pipe()
    if os.fork():
        os.close(ready_w)
        ok = os.read(ready_r, 1) == b"1"  # EOF (b"") if the poller exited before taking its lock
        return 0 if ok else 1
    os.close(ready_r)
    os.setsid()
    from lora_worker.run.slurm.process import serve

    return serve(ready_w)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The detaching fork shared by the two long-lived processes the web starts: a job's supervisor
(`python -m lora_worker.run`) and the Slurm poller (`python -m lora_worker.slurm`).

The process the web started forks once more and the first process exits, so the web reaps it and never
keeps a zombie; the second, re-parented to init (or the unit's subreaper), leads a session of its own and
writes one byte to the ready pipe once it holds its lock:
  - with `--ready-fd=N` (what run/local.py's `start_detached` passes), straight to the web's end of the pipe:
    the first process exits at once and the web waits on the pipe itself, not on a process's exit;
  - without it (started by hand, or by a launcher that only waits for the exit), the first process waits
    for that byte on a pipe of its own and exits 0 once it came, 1 if the second died before.
Only `os` is imported at the top: whatever comes before the fork delays the web's answer.
"""
from __future__ import annotations

import os

READY_FD_FLAG = "--ready-fd="
READY = b"1"  # what the detached process writes on the ready pipe once it holds its lock
# The job lock's path, named by the web for a job's supervisor, which takes it right after the fork.
JOB_LOCK_ENV = "LORA_WORKER_JOB_LOCK"
LOCK_WAIT_S = 10.0  # a reconcile's or admission's shared probe holds a lock for microseconds


def ready_fd_arg(arg: str) -> int | None:
    """N of a `--ready-fd=N` argument, or None if `arg` is not one."""
    value = arg[len(READY_FD_FLAG):] if arg.startswith(READY_FD_FLAG) else ""
    return int(value) if value.isdigit() else None


def detach(ready_fd: int | None) -> tuple[int | None, int]:
    """Fork. In the first process: (its exit status, -1). In the detached one: (None, the fd to write the ready
    byte to)."""
    if ready_fd is not None:
        if os.fork():
            os.close(ready_fd)  # from here the second alone holds it: its death before ready is an EOF there
            return 0, -1
        ready_w = ready_fd
    else:
        ready_r, ready_w = os.pipe()
        if os.fork():
            os.close(ready_w)
            ok = os.read(ready_r, 1) == READY  # EOF (b"") if the second died before taking its lock
            return (0 if ok else 1), -1
        os.close(ready_r)
    os.setsid()  # leader of its own session and group: signals aimed at the starter's group miss it
    return None, ready_w


def detached_main(argv: list[str], usage: str, serve_module: str) -> int:
    """`python -m <package> [--ready-fd=N]` of a long-lived process: fork off (`detach`), then, in the detached
    one only, import `serve_module` and run its `serve(ready_fd)`. Its imports come after the fork: whatever
    comes before it delays the caller's answer."""
    import sys

    if len(argv) > 1 or (argv and ready_fd_arg(argv[0]) is None):
        print(usage, file=sys.stderr)
        return 2
    status, ready_w = detach(ready_fd_arg(argv[0]) if argv else None)
    if status is not None:
        return status
    import importlib

    rc = importlib.import_module(serve_module).serve(ready_w)
    return int(rc)

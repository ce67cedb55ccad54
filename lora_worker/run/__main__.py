"""`python -m lora_worker.run <job_id> [--ready-fd=N]`: become the job's detached supervisor.

Started by the web process in a new session. It forks once more and the first process exits, so the web
reaps it and never keeps a zombie; the real supervisor is re-parented to init (or the unit's subreaper) and
lives on. Once it holds the job lock it writes one byte to the ready pipe:
  - with `--ready-fd=N` (what run/local.py passes), straight to the web's end of the pipe: the first process
    exits at once and the web's POST waits on the pipe itself, not on a process's exit;
  - without it (started by hand, or by a launcher that only waits for the exit), the first process waits
    for that byte on a pipe of its own and exits 0 once it came, 1 if the supervisor died before.
Only `os` and `sys` are imported before the fork.
"""
from __future__ import annotations

import os
import sys

READY_FD_FLAG = "--ready-fd="
USAGE = "usage: python -m lora_worker.run <job_id> [--ready-fd=N]"


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or not argv[0].isdigit() or (
            len(argv) == 2 and not (argv[1].startswith(READY_FD_FLAG) and argv[1][len(READY_FD_FLAG):].isdigit())):
        print(USAGE, file=sys.stderr)
        return 2
    job_id = int(argv[0])
    if len(argv) == 2:
        ready_w = int(argv[1][len(READY_FD_FLAG):])
        if os.fork():
            os.close(ready_w)  # from here the supervisor alone holds it: its death before ready is an EOF there
            return 0
    else:
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

"""The supervisor's end, timed (issue #18: no one-off end cost over 10 ms), for bench/memory.py.

One paced run of the stream benchmark's emitter under the real supervisor, followed from outside by polling
/proc every 0.5 ms: the trainer's exit (the emitter a zombie or gone), the final state's commit (the
terminal event's `at`, set right before the COMMIT, in ms), and the supervisor's exit (a zombie: we are its
subreaper). Between the first two: the drain of the pipe, the last progress write, the outcome and the
terminal write. After the commit: the supervisor's lock released, its ledger closed, the interpreter's
teardown — the one-off cost the target is about.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from bench.common import insert_job, state, supervisor_pid
from bench.stream import Runs, emitter_argv
from lora_worker.ledger import repository as repo
from lora_worker.run.local import launch_supervisor
from tests.helpers import wait_for

POLL_S = 0.0005


def time_the_end(runs: Runs, redraws: int = 60) -> tuple[float, float]:
    """(trainer exit → final state committed, that commit → supervisor exit), seconds, of one paced run."""
    go = runs.go()
    job_id = insert_job(runs.db, emitter_argv(go, "--redraws", str(redraws), "--rate", "60"),
                        runs.host.settings.train_root)
    launch_supervisor(job_id, runs.host.settings)
    pid = supervisor_pid(runs.db, job_id)  # our child (we are a subreaper): a zombie until we reap it
    ready = Path(str(go) + ".ready")
    wait_for(ready.exists, timeout=300, interval=0.005, what="the emitter to render its output")
    trainer = int(ready.read_text())
    go.touch()
    trainer_gone: float | None = None
    while state(pid) not in ("Z", None):
        if trainer_gone is None and state(trainer) in ("Z", None):
            trainer_gone = time.time()
        time.sleep(POLL_S)
    exited = time.time()
    os.waitpid(pid, 0)
    committed = repo.job_events(runs.db, job_id)[-1].at.timestamp()
    assert trainer_gone is not None, "the supervisor exited before its trainer"
    return committed - trainer_gone, exited - committed

"""The supervisor process proper, after the detaching fork: settings, lock, ledger, run."""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

from lora_worker.config import load_settings, settings_from_json
from lora_worker.logs import configure_logging
from lora_worker.host.detach import LOCK_WAIT_S, READY
from lora_worker.run.local import SETTINGS_ENV, listen_for_wakeups
from lora_worker.host.locks import job_lock_path, take_lock

log = logging.getLogger(__name__)


def serve(job_id: int, ready_fd: int, lock_fd: int | None = None) -> int:
    """Attend the job. `lock_fd` is the job lock when run/__main__.py took it already (and wrote the ready byte:
    `ready_fd` is then -1); otherwise it is taken here, from the settings, and the ready byte written after."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the session it came from may close its terminal
    wake_fd = listen_for_wakeups()  # before the row names this process, so its first wake-up lands
    configure_logging(job_id=job_id)
    raw = os.environ.get(SETTINGS_ENV)
    settings = settings_from_json(raw) if raw else load_settings()
    if lock_fd is None:
        lock_fd = take_lock(job_lock_path(settings, job_id), LOCK_WAIT_S)
        if lock_fd is None:
            log.error("job %s: another supervisor holds the job lock", job_id)
            os.close(ready_fd)
            return 1
        os.write(ready_fd, READY)
        os.close(ready_fd)
    # Imported only now: the web's POST /train waits for the lock above, not for the runner to load. The
    # ledger is the stdlib sqlite3 path (ledger/supervisor.py): no SQLAlchemy in this process.
    from lora_worker.run.seam import SupervisorHost
    from lora_worker.ledger.supervisor import SupervisorLedger
    from lora_worker.run.runner import attend

    # NORMAL: a power loss kills the run anyway, and the boot id reconciles it.
    db = SupervisorLedger(settings.database_path, busy_timeout_s=settings.supervisor_busy_timeout_s,
                          synchronous="NORMAL")
    return leave(attend(job_id, settings, SupervisorHost(wake_fd), db, lock_fd))  # attend releases the job lock last


def leave(rc: int) -> NoReturn:
    """End the supervisor once the run is recorded, its log and ledger closed and its locks released: without
    the interpreter's teardown of its imports, 10–15 ms of CPU spent on nothing at the end of every job."""
    logging.shutdown()  # what atexit would have flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

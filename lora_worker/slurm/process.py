"""The poller process: one per worker, detached like a job's supervisor, alive while it holds
`<state>/locks/slurm-poller.lock`, and well while its heartbeat is fresh.

`ensure_poller` (the web: after each submission, and whenever reconcile asks after a Slurm job) starts
`python -m lora_worker.slurm` if no process holds the lock, and returns once one does. The process is in a
session of its own and re-parented to init, so it outlives the web; a second one cannot take the lock and
exits at once. While the lock is held and the heartbeat fresh, reconcile leaves Slurm rows to the poller.
The heartbeat (`<state>/locks/slurm-poller.beat`: who the poller is, and when it last moved) is written at
each cycle and after each job: a poller that holds its lock but is stuck (in a read from a hung mount, a
command that never returns) stops beating, and `replace_stuck` kills that very process (identity-pinned)
so that a new one can take the lock. When the poller dies the kernel drops the lock, and the next reconcile
starts a new one, which resumes every active Slurm row.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from lora_worker.config import Settings, load_settings, settings_from_json, settings_to_json
from lora_worker.errors import LaunchFailed
from lora_worker.host import processes
from lora_worker.host.detach import READY
from lora_worker.host.locks import is_locked, take_lock
from lora_worker.host.starter import SETTINGS_ENV, start_detached

log = logging.getLogger(__name__)

LOCK_WAIT_S = 2.0
STUCK_AFTER_S = 300.0  # no beat for this long: stuck (a cycle's commands each time out after 30 s)


def poller_lock_path(settings: Settings) -> Path:
    return settings.lock_dir / "slurm-poller.lock"


def beat_path(settings: Settings) -> Path:
    return settings.lock_dir / "slurm-poller.beat"


def poller_running(settings: Settings) -> bool:
    return is_locked(poller_lock_path(settings))


def beat(settings: Settings, now: float | None = None) -> None:
    """`<boot id> <pid> <start ticks> <wall time>` of this process, replaced atomically."""
    me = processes.identity_of(os.getpid())
    if me is None:
        return
    path = beat_path(settings)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{me.boot_id} {me.pid} {me.start_ticks} {time.time() if now is None else now:.3f}\n")
        os.replace(tmp, path)
    except OSError as exc:  # a full disk: the poller goes on; a reconcile may take it for stuck
        log.warning("slurm poller: cannot write its heartbeat (%s)", exc)


def stuck_poller(settings: Settings, now: float | None = None) -> processes.Identity | None:
    """The poller holding the lock, if its last beat is older than STUCK_AFTER_S; None if it is well (or
    none beats: a poller that cannot be named is never killed)."""
    try:
        boot, pid, ticks, at = beat_path(settings).read_text().split()
        ident, beat_at = processes.Identity(boot, int(pid), int(ticks)), float(at)
    except (OSError, ValueError):
        return None
    if (time.time() if now is None else now) - beat_at < STUCK_AFTER_S:
        return None
    return ident if poller_running(settings) else None


def replace_stuck(settings: Settings, ident: processes.Identity) -> bool:
    """SIGKILL the stuck poller (that very process, pinned by a pidfd) and wait for its lock to go; True if it
    went, so a new poller can take the lock."""
    log.error("slurm poller %s has not moved in %gs; killing it so another can take over", ident.pid, STUCK_AFTER_S)
    try:
        processes.signal_identity(ident, signal.SIGKILL)
    except OSError as exc:
        log.warning("slurm poller %s: cannot signal it (%s)", ident.pid, exc)
    deadline = time.monotonic() + LOCK_WAIT_S
    while poller_running(settings) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not poller_running(settings)


def ensure_poller(settings: Settings) -> None:
    """Return once a poller holds the lock (this call's, or one already there); LaunchFailed if none does."""
    if poller_running(settings):
        return
    env = dict(os.environ)
    env[SETTINGS_ENV] = settings_to_json(settings)
    try:
        start_detached([sys.executable, "-m", "lora_worker.slurm"], env, what="The Slurm poller")
    except LaunchFailed:
        if not poller_running(settings):  # a poller started by someone else meanwhile is as good
            raise


def serve(ready_fd: int) -> int:
    """The poller proper, after the detaching fork: lock, heartbeat, handshake, then cycles until SIGTERM."""
    from lora_worker.logs import configure_logging

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    configure_logging()
    raw = os.environ.get(SETTINGS_ENV)
    settings = settings_from_json(raw) if raw else load_settings()
    lock_fd = take_lock(poller_lock_path(settings), LOCK_WAIT_S)
    if lock_fd is None:
        log.info("slurm poller: another poller holds %s", poller_lock_path(settings))
        os.close(ready_fd)
        return 1
    beat(settings)
    os.write(ready_fd, READY)
    os.close(ready_fd)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
    from lora_worker.ledger.db import Database
    from lora_worker.slurm.poller import Poller
    from lora_worker.slurm.scheduler import Scheduler

    db = Database.open(settings.database_path, busy_timeout_s=settings.supervisor_busy_timeout_s,
                       synchronous="NORMAL")
    poller = Poller(settings, db, Scheduler(settings.slurm_bin_dir), time.monotonic, beat=lambda: beat(settings))
    log.info("slurm poller %s: following the ledger's Slurm jobs every %gs", os.getpid(),
             settings.slurm_poll_interval_s)
    try:
        while not stop:
            started = time.monotonic()
            try:
                poller.cycle()
            except Exception:  # one bad cycle must not end the process every Slurm job depends on
                log.exception("slurm poller: cycle failed")
            time.sleep(max(0.0, settings.slurm_poll_interval_s - (time.monotonic() - started)))
    finally:
        poller.close()
        db.dispose()
        os.close(lock_fd)  # last: from here reconcile may start another poller
    return 0

"""The one sender process: `python -m lora_worker.webhooks`, alive while it holds `<state>/locks/webhooks.lock`.

Under systemd it is its own unit (`lora-worker-webhooks.service`, Restart=always). Where no unit runs it (a
checkout, the demo, a test), `ensure_sender` (the web: at start-up and after each dispatch) starts one,
detached like a job's supervisor, if no process holds the lock; a second sender cannot take the lock and
exits at once. `stop_sender` ends the one running (the demo's and the tests' teardown).
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
from lora_worker.host.detach import READY
from lora_worker.host.locks import is_locked, lock_state, take_lock
from lora_worker.run.local import SETTINGS_ENV, start_detached

log = logging.getLogger(__name__)

LOCK_WAIT_S = 2.0
IDLE_POLL_S = 0.5  # how soon an event written by another process is seen when nothing else is due


def sender_lock_path(settings: Settings) -> Path:
    return settings.lock_dir / "webhooks.lock"


def sender_running(settings: Settings) -> bool:
    return is_locked(sender_lock_path(settings))


def ensure_sender(settings: Settings) -> None:
    """Start a sender unless one holds the lock; nothing without a target. A sender that cannot start is
    logged, never an error of the request that asked: its events wait in the outbox for the next one."""
    if not settings.webhook_url or sender_running(settings):
        return
    env = dict(os.environ)
    env[SETTINGS_ENV] = settings_to_json(settings)
    try:
        start_detached([sys.executable, "-m", "lora_worker.webhooks"], env, what="The webhook sender")
    except LaunchFailed as exc:
        if not sender_running(settings):
            log.error("webhooks: %s; events wait in the outbox", exc.message)


def stop_sender(settings: Settings, timeout_s: float = 10.0) -> None:
    pid = lock_state(sender_lock_path(settings)).holder_pid
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while sender_running(settings) and time.monotonic() < deadline:
        time.sleep(0.02)


def serve(ready_fd: int) -> int:
    """The sender proper, after the detaching fork: lock, handshake, then cycles until SIGTERM."""
    from lora_worker.logs import configure_logging

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    configure_logging()
    raw = os.environ.get(SETTINGS_ENV)
    settings = settings_from_json(raw) if raw else load_settings()
    if not settings.webhook_url:  # the unit on a host that sends no webhooks: nothing to do, and no error
        log.info("webhooks: no webhook_url is configured; nothing to send")
        os.close(ready_fd)
        return 0
    lock_fd = take_lock(sender_lock_path(settings), LOCK_WAIT_S)
    if lock_fd is None:
        log.info("webhooks: another sender holds %s", sender_lock_path(settings))
        os.close(ready_fd)
        return 1
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
    from lora_worker.ledger.db import Database
    from lora_worker.webhooks.sender import Sender
    from lora_worker.webhooks.signing import load_secrets

    from lora_worker.errors import ConfigError

    try:
        keys = load_secrets(settings)
    except ConfigError as exc:  # no signed request can leave: say why once, and let the events wait
        log.error("webhooks: %s", exc)
        os.close(ready_fd)
        os.close(lock_fd)
        return 1
    db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s, synchronous="NORMAL")
    sender = Sender(settings, db, keys)
    os.write(ready_fd, READY)
    os.close(ready_fd)
    interrupted = sender.recover()
    log.info("webhook sender %s: delivering to %s (%d attempt(s) of a stopped sender will be repeated)",
             os.getpid(), settings.webhook_url, interrupted)
    try:
        while not stop:
            try:
                if sender.cycle() == 0:
                    time.sleep(sender.seconds_until_due(IDLE_POLL_S))
            except Exception:  # one bad cycle (a busy ledger) must not end the process every event needs
                log.exception("webhooks: cycle failed")
                time.sleep(IDLE_POLL_S)
    finally:
        db.dispose()
        os.close(lock_fd)
    return 0

"""The one sender process: `python -m lora_worker.webhooks`, alive while it holds `<state>/locks/webhooks.lock`.

Under systemd it is its own unit (`lora-worker-webhooks.service`, Restart=always): the unit starts it, and its
cgroup ends it (a stop kills every process in it). The web never starts one there (`ensure_sender`): a sender
it started would live in the web's unit, outside the sender's. Where no unit runs it (a checkout, the demo, a
test), `ensure_sender` (the web: at start-up and after each dispatch) starts one, detached like a job's
supervisor, if no process holds the lock; a second sender cannot take the lock and exits at once. Detached, it
outlives a restart of the web; where its starter named a process for it to die with (the demo, lifeline.py),
it stops once that process is gone. `stop_sender` ends the one running (the demo's and the tests' teardown).
"""
from __future__ import annotations

import logging
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lora_worker.config import Settings, load_settings, settings_from_json, settings_to_json
from lora_worker.errors import LaunchFailed
from lora_worker.host.detach import READY
from lora_worker.host.locks import is_locked, lock_state, take_lock
from lora_worker.run.local import SETTINGS_ENV, start_detached
from lora_worker.webhooks.lifeline import Lifeline

if TYPE_CHECKING:
    from lora_worker.webhooks.signing import Keyring

log = logging.getLogger(__name__)

LOCK_WAIT_S = 2.0
IDLE_POLL_S = 0.5  # how soon an event written by another process is seen when nothing else is due
# systemd sets it in every unit's processes: there the sender's own unit runs the sender, never the web.
SYSTEMD_ENV = "INVOCATION_ID"


def sender_lock_path(settings: Settings) -> Path:
    return settings.lock_dir / "webhooks.lock"


def sender_running(settings: Settings) -> bool:
    return is_locked(sender_lock_path(settings))


def ensure_sender(settings: Settings) -> None:
    """Start a sender unless one holds the lock; nothing without a target, nor under systemd (the sender's unit
    runs it). A sender that cannot start is logged, never an error of the request that asked: its events wait
    in the outbox for the next one."""
    if not settings.webhook_url or os.environ.get(SYSTEMD_ENV) or sender_running(settings):
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
    """The sender proper, after the detaching fork: lock, handshake, then cycles until SIGTERM (or until the
    process it was told to die with is gone)."""
    from lora_worker.logs import configure_logging

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    configure_logging()
    raw = os.environ.get(SETTINGS_ENV)
    settings = settings_from_json(raw) if raw else load_settings()
    lifeline = Lifeline.from_environ()
    if not settings.webhook_url or (lifeline is not None and lifeline.gone()):
        # The unit on a host that sends no webhooks, or a demo already gone: nothing to do, and no error.
        log.info("webhooks: %s; nothing to send", "no webhook_url is configured" if not settings.webhook_url
                 else "the process this sender was to die with has ended")
        os.close(ready_fd)
        return 0
    lock_fd = take_lock(sender_lock_path(settings), LOCK_WAIT_S)
    if lock_fd is None:
        log.info("webhooks: another sender holds %s", sender_lock_path(settings))
        os.close(ready_fd)
        return 1
    from lora_worker.errors import ConfigError
    from lora_worker.webhooks.signing import Keyring

    try:
        keys = Keyring.watching(settings)
    except ConfigError as exc:  # no signed request can leave: say why once, and let the events wait
        log.error("webhooks: %s", exc)
        # The lock first: the starter acts on the pipe's EOF at once (ensure_sender asks whether a sender runs),
        # and this process may be descheduled between two closes for as long as a loaded machine likes.
        os.close(lock_fd)
        os.close(ready_fd)
        return 1
    try:
        _deliver(settings, keys, lifeline, ready_fd)
    finally:
        os.close(lock_fd)
    return 0


def _say_ready(ready_fd: int) -> None:
    """The handshake byte. A starter that stopped waiting (its bound ran out on a slow machine: a cold page cache
    under load made a start take over 20 s) has closed its end: the lock is this sender's all the same, so it
    delivers, rather than die and leave every event waiting for the next start."""
    try:
        os.write(ready_fd, READY)
    except BrokenPipeError:
        log.warning("webhooks: the process that started this sender stopped waiting for it; delivering anyway")
    finally:
        os.close(ready_fd)


def _deliver(settings: Settings, keys: Keyring, lifeline: Lifeline | None, ready_fd: int) -> None:
    """The handshake, then the loop: start what is due, sleep until the next is due, an attempt ends, a signal
    comes, or at most IDLE_POLL_S (an event another process wrote, the lifeline). On the way out, the attempts
    in flight end (each within its deadline)."""
    from lora_worker.ledger.db import Database
    from lora_worker.webhooks.sender import Sender

    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stop: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stop.append(signum))
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)  # a signal wakes the poll below at once
    db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s, synchronous="NORMAL")
    sender = Sender(settings, db, keys, on_done=lambda: _wake(wake_w))
    _say_ready(ready_fd)
    poller = select.poll()
    poller.register(wake_r, select.POLLIN)
    try:
        interrupted = sender.recover()
        log.info("webhook sender %s: delivering to %s (%d attempt(s) of a stopped sender will be repeated)",
                 os.getpid(), settings.webhook_url, interrupted)
        while not stop and not (lifeline is not None and lifeline.gone()):
            try:
                sender.start_due()
                until = sender.seconds_until_due(IDLE_POLL_S)
            except Exception:  # one bad cycle (a busy ledger) must not end the process every event needs
                log.exception("webhooks: cycle failed")
                until = IDLE_POLL_S
            # Something due that could not start (its job's attempt in flight, every slot taken) waits for an
            # attempt to end, which wakes this poll, or for the idle poll: never a busy loop.
            if poller.poll((until or IDLE_POLL_S) * 1000):
                _drain(wake_r)
    finally:
        signal.set_wakeup_fd(-1)
        sender.close()
        db.dispose()
        os.close(wake_r)
        os.close(wake_w)
    if lifeline is not None and lifeline.gone() and not stop:
        log.info("webhook sender %s: the process it was to die with has ended; stopping", os.getpid())


def _wake(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass  # full: the loop wakes anyway


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass

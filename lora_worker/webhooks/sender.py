"""The sender's loop: every due event, oldest first within each job, one attempt each, the outcome recorded.

- An attempt is opened in the outbox before its request leaves and closed with the answer, each in its own
  transaction, so a sender killed in the middle leaves the event pending: the next one closes that attempt as
  interrupted and sends the event again, under the same id (at least once).
- 2xx: delivered. 410 Gone: the receiver says this will never be wanted; given up at once. Anything else (an
  error, a timeout, 3xx, 4xx, 5xx): tried again after an exponential backoff with full jitter
  (`BASE_DELAY_S` · 2^attempts, at most `MAX_DELAY_S`), or after Retry-After when the receiver says longer
  (at most `MAX_DELAY_S` too), until the event's give-up age (`webhook_give_up_s` from when it was written):
  then given up.
- A job's next event waits until the one before it is delivered or given up: events arrive in order per job.
- One job's trouble is that job's: up to `MAX_IN_FLIGHT` attempts run at once, each for a different job, each
  bounded by one deadline (delivery.py), so an event whose receiver stalls or asks it to wait never holds
  another job's events. A job waits for others only while `MAX_IN_FLIGHT` attempts of other jobs are all in
  flight, and then for at most one deadline. Whatever goes wrong with one event beyond its answer (a fault in
  this code, a ledger write refused) is contained to it: logged, the event set aside for a backoff, the others
  go on (`_contained`).
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from functools import partial

from lora_worker.config import Settings
from lora_worker.ledger import outbox
from lora_worker.ledger.db import Database
from lora_worker.ledger.statements import Statements
from lora_worker.ledger.timestamps import utcnow
from lora_worker.webhooks import delivery, signing

log = logging.getLogger(__name__)

BASE_DELAY_S = 1.0
MAX_DELAY_S = delivery.MAX_RETRY_AFTER_S
GONE = 410
MAX_IN_FLIGHT = 4  # attempts at once, each for its own job: a few stalled receivers hold no other job

Post = Callable[..., delivery.Answer]


def backoff_s(attempts: int, rng: Callable[[], float] = random.random) -> float:
    """The wait before attempt `attempts + 1`: full jitter over an exponential ceiling (never 0, so a receiver
    that fails at once is not hammered)."""
    ceiling = min(MAX_DELAY_S, BASE_DELAY_S * 2.0 ** min(max(0, attempts - 1), 64))
    return max(BASE_DELAY_S / 10, ceiling * rng())


def retry_wait_s(attempts: int, retry_after_s: float | None, rng: Callable[[], float] = random.random) -> float:
    """The wait before the next attempt: the backoff, or Retry-After when it asks for longer; never over
    `MAX_DELAY_S`, whatever it asked."""
    asked = retry_after_s if retry_after_s is not None and math.isfinite(retry_after_s) else 0.0
    return min(MAX_DELAY_S, max(backoff_s(attempts, rng), asked))


class Sender:
    def __init__(self, settings: Settings, db: Database, keys: signing.Keyring | Sequence[bytes], *,
                 post: Post = delivery.post, rng: Callable[[], float] = random.random,
                 clock: Callable[[], float] = time.time, on_done: Callable[[], None] = lambda: None) -> None:
        """`on_done` is called (from the attempt's thread) whenever an attempt ends: the loop's wake-up."""
        if not settings.webhook_url:
            raise ValueError("a sender needs webhook_url")
        self.settings, self.db = settings, db
        self.keyring = keys if isinstance(keys, signing.Keyring) else signing.Keyring(keys)
        self.url: str = settings.webhook_url
        self.post, self.rng, self.clock, self.on_done = post, rng, clock, on_done
        self.pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="webhook")
        self.in_flight: dict[int, Future[None]] = {}  # job id → its attempt
        self.set_aside: dict[int, float] = {}  # job id → monotonic time: a fault we may not have recorded
        self.lock = threading.RLock()  # a done callback may run at once, in the thread that added it

    def recover(self) -> int:
        """Close the attempts a dead sender left open; their events go again. Only the lock's holder may."""
        with self.db.writing() as db:
            return outbox.close_interrupted(db)

    def start_due(self) -> list[Future[None]]:
        """Start an attempt for each due event whose job has none in flight and is not set aside, while fewer
        than `MAX_IN_FLIGHT` are; the attempts started (they run on, in their own threads)."""
        with self.db.reading() as db:
            heads = outbox.due(db)
        started: list[Future[None]] = []
        now = time.monotonic()
        with self.lock:
            for job_id in [j for j, until in self.set_aside.items() if until <= now]:
                del self.set_aside[job_id]
            for event in heads:
                if len(self.in_flight) >= MAX_IN_FLIGHT:
                    break
                if event.job_id in self.in_flight or event.job_id in self.set_aside:
                    continue
                future = self.pool.submit(self._contained, event)
                self.in_flight[event.job_id] = future
                future.add_done_callback(partial(self._finished, event.job_id))
                started.append(future)
        return started

    def cycle(self) -> int:
        """`start_due`, then wait for those attempts to end; how many were tried."""
        started = self.start_due()
        wait(started)
        return len(started)

    def seconds_until_due(self, cap_s: float) -> float:
        with self.db.reading() as db:
            when = outbox.next_due_at(db)
        if when is None:
            return cap_s
        return min(cap_s, max(0.0, (when - utcnow()).total_seconds()))

    def close(self) -> None:
        """Start nothing more; wait for the attempts in flight (each bounded by its deadline)."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _finished(self, job_id: int, _future: Future[None]) -> None:
        with self.lock:
            self.in_flight.pop(job_id, None)
        self.on_done()

    def _contained(self, event: outbox.Due) -> None:
        """One event's attempt, whatever happens in it: a fault is this event's alone, never the loop's."""
        try:
            self.attempt(event)
        except Exception as exc:
            wait_s = backoff_s(event.attempts + 1, self.rng)
            log.exception("webhooks: event %s of job %s failed in the sender; set aside for %.1fs", event.event_id,
                          event.job_id, wait_s)
            with self.lock:  # no tight loop, even when the ledger refuses to record the failure
                self.set_aside[event.job_id] = time.monotonic() + wait_s
            try:
                with self.db.writing() as db:
                    outbox.retry_at(db, event.pk, utcnow() + timedelta(seconds=wait_s), _fault(exc))
            except Exception:
                log.exception("webhooks: could not record the failure of event %s", event.event_id)

    def attempt(self, event: outbox.Due) -> None:
        if utcnow() >= event.give_up_at:
            with self.db.writing() as db:
                outbox.give_up(db, event.pk, f"not delivered within {self.settings.webhook_give_up_s:g}s "
                                             "of being written")
            log.warning("webhook %s (%s of job %s) given up: past its give-up age", event.event_id, event.type,
                        event.job_id)
            return
        with self.db.writing() as db:
            attempt_id = outbox.begin_attempt(db, event.pk)
        try:
            answer = self._send(event)
        except Exception as exc:  # a fault of ours: post() turns whatever the receiver does into an Answer
            log.exception("webhooks: sending event %s failed", event.event_id)
            answer = delivery.Answer(None, 0.0, _fault(exc))
        with self.db.writing() as db:
            outbox.finish_attempt(db, attempt_id, status_code=answer.status, latency_ms=answer.latency_ms,
                                  error=answer.error)
            self._settle(db, event, answer)

    def _send(self, event: outbox.Due) -> delivery.Answer:
        body = event.body.encode()
        headers = signing.headers(self.keyring.keys(), event.event_id, int(self.clock()), body)
        return self.post(self.url, body, headers, connect_timeout_s=self.settings.webhook_connect_timeout_s,
                         read_timeout_s=self.settings.webhook_read_timeout_s)

    def _settle(self, db: Statements, event: outbox.Due, answer: delivery.Answer) -> None:
        if answer.delivered:
            outbox.delivered(db, event.pk)
        elif answer.status == GONE:
            outbox.give_up(db, event.pk, "the receiver answered 410 Gone")
            log.warning("webhook %s of job %s given up: the receiver answered 410 Gone", event.event_id,
                        event.job_id)
        else:
            wait_s = retry_wait_s(event.attempts + 1, answer.retry_after_s, self.rng)
            outbox.retry_at(db, event.pk, utcnow() + timedelta(seconds=wait_s), answer.error or "failed")


def _fault(exc: BaseException) -> str:
    return f"sender error: {type(exc).__name__}: {exc}"[:delivery.MAX_ERROR_CHARS]

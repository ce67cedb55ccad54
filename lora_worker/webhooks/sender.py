"""The sender's loop: every due event, oldest first within each job, one attempt each, the outcome recorded.

- An attempt is opened in the outbox before its request leaves and closed with the answer, each in its own
  transaction, so a sender killed in the middle leaves the event pending: the next one closes that attempt as
  interrupted and sends the event again, under the same id (at least once).
- 2xx: delivered. 410 Gone: the receiver says this will never be wanted; given up at once. Anything else (an
  error, a timeout, 3xx, 4xx, 5xx): tried again after an exponential backoff with full jitter
  (`BASE_DELAY_S` · 2^attempts, at most `MAX_DELAY_S`), or after Retry-After when the receiver says longer,
  until the event's give-up age (`webhook_give_up_s` from when it was written): then given up.
- A job's next event waits until the one before it is delivered or given up: events arrive in order per job.
  Jobs do not wait for each other beyond one attempt's timeouts.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from lora_worker.config import Settings
from lora_worker.ledger import outbox
from lora_worker.ledger.db import Database
from lora_worker.ledger.statements import Statements
from lora_worker.ledger.timestamps import utcnow
from lora_worker.webhooks import delivery, signing

log = logging.getLogger(__name__)

BASE_DELAY_S = 1.0
MAX_DELAY_S = 3600.0
GONE = 410

Post = Callable[..., delivery.Answer]


def backoff_s(attempts: int, rng: Callable[[], float] = random.random) -> float:
    """The wait before attempt `attempts + 1`: full jitter over an exponential ceiling (never 0, so a receiver
    that fails at once is not hammered)."""
    ceiling = min(MAX_DELAY_S, BASE_DELAY_S * 2.0 ** max(0, attempts - 1))
    return max(BASE_DELAY_S / 10, ceiling * rng())


class Sender:
    def __init__(self, settings: Settings, db: Database, keys: Sequence[bytes], *, post: Post = delivery.post,
                 rng: Callable[[], float] = random.random, clock: Callable[[], float] = time.time) -> None:
        if not settings.webhook_url:
            raise ValueError("a sender needs webhook_url")
        self.settings, self.db, self.keys = settings, db, list(keys)
        self.url: str = settings.webhook_url
        self.post, self.rng, self.clock = post, rng, clock

    def recover(self) -> int:
        """Close the attempts a dead sender left open; their events go again. Only the lock's holder may."""
        with self.db.writing() as db:
            return outbox.close_interrupted(db)

    def cycle(self) -> int:
        """One attempt for every event due now; how many were tried."""
        with self.db.reading() as db:
            heads = outbox.due(db)
        for event in heads:
            self.attempt(event)
        return len(heads)

    def seconds_until_due(self, cap_s: float) -> float:
        with self.db.reading() as db:
            when = outbox.next_due_at(db)
        if when is None:
            return cap_s
        return min(cap_s, max(0.0, (when - utcnow()).total_seconds()))

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
        body = event.body.encode()
        answer = self.post(self.url, body, signing.headers(self.keys, event.event_id, int(self.clock()), body),
                           connect_timeout_s=self.settings.webhook_connect_timeout_s,
                           read_timeout_s=self.settings.webhook_read_timeout_s)
        with self.db.writing() as db:
            outbox.finish_attempt(db, attempt_id, status_code=answer.status, latency_ms=answer.latency_ms,
                                  error=answer.error)
            self._settle(db, event, answer)

    def _settle(self, db: Statements, event: outbox.Due, answer: delivery.Answer) -> None:
        if answer.delivered:
            outbox.delivered(db, event.pk)
        elif answer.status == GONE:
            outbox.give_up(db, event.pk, "the receiver answered 410 Gone")
            log.warning("webhook %s of job %s given up: the receiver answered 410 Gone", event.event_id,
                        event.job_id)
        else:
            wait = max(backoff_s(event.attempts + 1, self.rng), answer.retry_after_s or 0.0)
            outbox.retry_at(db, event.pk, utcnow() + timedelta(seconds=wait), answer.error or "failed")

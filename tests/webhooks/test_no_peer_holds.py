"""No receiver holds the sender (issue #38): one deadline bounds an attempt however slowly the receiver drips
its answer; a Retry-After that overflows or does not parse is clamped or ignored, and holds no other job; a
receiver stalling one job's event holds no other job's events; a fault in one event's attempt is that event's;
a rotated secret signs from the next request, without a restart."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
from standardwebhooks.webhooks import WebhookVerificationError

from lora_worker.ledger import outbox
from lora_worker.ledger.timestamps import iso_utc, utcnow
from lora_worker.webhooks import delivery
from lora_worker.webhooks.process import ensure_sender, sender_lock_path
from lora_worker.host.locks import lock_state
from tests.helpers import wait_for
from tests.webhooks.jobs import a_finished_job, run_until, sender_for, states
from tests.webhooks.receiver import Answer, new_secret, write_secrets

DRIP_S = 12.0  # how long the dripping receiver goes on: far past any deadline below
GENEROUS_MS = 3000.0  # a loaded machine's slack over a deadline: still far below DRIP_S


def dripping_receiver(head: bytes, every_s: float = 0.05) -> tuple[str, socket.socket]:
    """A receiver that answers `head`, then one more byte every `every_s` seconds for DRIP_S: each read gets
    something well within any per-read timeout, so only a deadline on the whole attempt ends it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    def drip(conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(head)
                ends = time.monotonic() + DRIP_S
                while time.monotonic() < ends:
                    conn.sendall(b"x")
                    time.sleep(every_s)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/hooks", listener


DRIPS = {"in the headers": b"HTTP/1.1 200 OK\r\nX-Slow: ",
         "in the body": b"HTTP/1.1 500 Oops\r\nContent-Length: 1000000\r\n\r\n"}


@pytest.mark.parametrize("where", DRIPS)
def test_an_attempt_ends_at_its_deadline_however_slowly_the_receiver_drips(hooked, hooked_db, where):
    url, listener = dripping_receiver(DRIPS[where])
    try:
        job_id = a_finished_job(hooked_db)
        sender_for(replace(hooked, webhook_url=url), hooked_db).cycle()
        with hooked_db.reading() as d:
            (attempt,) = outbox.deliveries(d, job_id)[0]["attempts"]
    finally:
        listener.close()
    deadline_ms = 1000 * (hooked.webhook_connect_timeout_s + hooked.webhook_read_timeout_s)  # docs/webhooks.md
    assert deadline_ms <= attempt["latency_ms"] < deadline_ms + GENEROUS_MS, attempt
    assert attempt["error"] == "timed out" and attempt["status_code"] is None
    assert deadline_ms == 1000 * delivery.attempt_deadline_s(hooked.webhook_connect_timeout_s,
                                                             hooked.webhook_read_timeout_s)


@pytest.mark.parametrize("value", ["999999999999", "²", "9" * 5000, "Fri, 31 Dec 9999 23:59:59 GMT"])
def test_a_retry_after_that_overflows_or_does_not_parse_holds_no_other_job(hooked, hooked_db, receiver, value):
    job_a, job_b = a_finished_job(hooked_db), a_finished_job(hooked_db)
    receiver.script = [Answer(429, {"Retry-After": value}, job_id=job_a)]  # job A's first event
    before = utcnow()
    run_until(sender_for(hooked, hooked_db), lambda: states(hooked_db, job_b) == ["delivered"] * 3)
    with hooked_db.reading() as d:
        head = outbox.deliveries(d, job_a)[0]
    assert [a["status_code"] for a in head["attempts"]] == [429] and head["attempts"][0]["finished_at"]
    assert head["state"] == "retrying"  # later: a digit only in Unicode's eyes counts as absent, a huge one as an hour
    assert iso_utc(before) <= head["next_attempt_at"] <= iso_utc(utcnow() + timedelta(seconds=3601))
    assert len(receiver.deliveries) == 4  # A's first, once; B's three; nothing hammered


@pytest.mark.slow
def test_a_receiver_stalling_one_jobs_event_holds_no_other_jobs_events(hooked, hooked_db, receiver, secret):
    hold = threading.Event()
    # Its attempt may last 121 s: far past the wait below, which covers a sender's start on a loaded machine (a
    # cold page cache once made one take over 20 s).
    settings = replace(hooked, webhook_read_timeout_s=120.0)
    job_a, job_b = a_finished_job(hooked_db), a_finished_job(hooked_db)
    receiver.script = [Answer(200, hold=hold, job_id=job_a)]  # job A's first event: no answer until released
    try:
        ensure_sender(settings)
        wait_for(lambda: states(hooked_db, job_b) == ["delivered"] * 3, timeout=60,
                 what="job B's events delivered while job A's first is held")
        with hooked_db.reading() as d:
            (held,) = outbox.deliveries(d, job_a)[0]["attempts"]
        assert held["finished_at"] is None  # still in flight: B did not wait for it
        assert states(hooked_db, job_a) == ["retrying", "pending", "pending"]  # A keeps its order
    finally:
        hold.set()
    wait_for(lambda: states(hooked_db, job_a) == ["delivered"] * 3, timeout=30, what="job A's events delivered")
    got = [d.verified(secret)["data"]["worker_job_id"] for d in receiver.deliveries]
    assert [j for j in got if j == job_a] == [job_a] * 3


def tried_often(db, job_id: int) -> None:
    """As if the job's head had been tried 10 times: its next backoff is minutes (at full jitter), so a test
    may see that it is set aside, and not tried again at once, however slow the machine."""
    with db.writing() as d:
        d.execute("UPDATE webhook_events SET attempts = 10 WHERE job_id = ?", (job_id,))


def test_a_fault_in_one_events_attempt_is_that_events_alone(hooked, hooked_db, receiver):
    job_a, job_b = a_finished_job(hooked_db), a_finished_job(hooked_db)
    tried_often(hooked_db, job_a)
    with hooked_db.reading() as d:
        poison = outbox.bodies(d, job_a)[0][0]

    def post(url, body, headers, **timeouts):
        if headers["webhook-id"] == poison:
            raise RuntimeError("a fault of the sender's own")
        return delivery.post(url, body, headers, **timeouts)

    sender = replace_post(sender_for(hooked, hooked_db, rng=lambda: 1.0), post)
    run_until(sender, lambda: states(hooked_db, job_b) == ["delivered"] * 3)
    with hooked_db.reading() as d:
        head = outbox.deliveries(d, job_a)[0]
    (attempt,) = head["attempts"]
    assert attempt["finished_at"] and attempt["error"].startswith("sender error: RuntimeError: a fault")
    assert head["state"] == "retrying" and head["next_attempt_at"] > iso_utc(utcnow())
    assert sender.cycle() == 0  # set aside: not tried again at once


def test_a_ledger_fault_recording_one_events_answer_is_that_events_alone(hooked, hooked_db, receiver,
                                                                          monkeypatch):
    job_a, job_b = a_finished_job(hooked_db), a_finished_job(hooked_db)
    tried_often(hooked_db, job_a)
    real = outbox.finish_attempt

    def finish(db, attempt_id, **answer):
        if db.execute("SELECT e.job_id FROM webhook_attempts a JOIN webhook_events e ON e.id = a.event_pk "
                      "WHERE a.id = ?", (attempt_id,)).fetchone()[0] == job_a:
            raise RuntimeError("the ledger refused")
        real(db, attempt_id, **answer)

    monkeypatch.setattr(outbox, "finish_attempt", finish)
    sender = sender_for(hooked, hooked_db, rng=lambda: 1.0)
    run_until(sender, lambda: states(hooked_db, job_b) == ["delivered"] * 3)
    assert sender.cycle() == 0  # job A is set aside for its backoff, not retried twice a second
    assert [d.event["data"]["worker_job_id"] for d in receiver.deliveries].count(job_a) == 1


def replace_post(sender, post):
    sender.post = post
    return sender


@pytest.mark.slow
def test_a_rotated_secret_signs_from_the_next_request_without_a_restart(hooked, hooked_db, receiver, secret):
    ensure_sender(hooked)
    pid = lock_state(sender_lock_path(hooked)).holder_pid

    def delivered(job_id: int) -> list:
        wait_for(lambda: states(hooked_db, job_id) == ["delivered"] * 3, timeout=30, what=f"job {job_id} delivered")
        return [d for d in receiver.deliveries if d.event["data"]["worker_job_id"] == job_id]

    assert all(d.verified(secret) for d in delivered(a_finished_job(hooked_db)))
    new = new_secret()
    write_secrets(hooked.webhook_secret_file, new, secret)  # rotation: the new one first, the old one kept
    for got in delivered(a_finished_job(hooked_db)):
        assert got.verified(new) == got.verified(secret)  # both sign while arbo may hold either
    write_secrets(hooked.webhook_secret_file, new)  # rotation done: the old one removed
    for got in delivered(a_finished_job(hooked_db)):
        assert got.verified(new)
        with pytest.raises(WebhookVerificationError):
            got.verified(secret)
    hooked.webhook_secret_file.write_text("whsec_!!! half an edit\n")  # unreadable: the last good keys go on
    assert all(d.verified(new) for d in delivered(a_finished_job(hooked_db)))
    assert lock_state(sender_lock_path(hooked)).holder_pid == pid  # one sender throughout: no restart

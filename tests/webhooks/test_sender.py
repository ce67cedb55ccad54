"""The sender against a real receiver on loopback: signed by the Standard Webhooks spec (checked with the
`standardwebhooks` package), in order per job, retried with backoff, Retry-After and 410 honoured, redirects
never followed, the answer read at most 64 KiB, given up at its age."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
from standardwebhooks.webhooks import WebhookVerificationError

from lora_worker.errors import ConfigError
from lora_worker.ledger import outbox
from lora_worker.ledger.timestamps import iso_utc, utcnow
from lora_worker.webhooks import delivery, signing
from lora_worker.webhooks.sender import backoff_s
from tests.webhooks.receiver import Answer, Delivery, new_secret, write_secrets
from tests.webhooks.jobs import a_finished_job, run_until, sender_for, states


def test_every_event_arrives_in_order_and_verifies_with_standardwebhooks(hooked, hooked_db, receiver, secret):
    job_id = a_finished_job(hooked_db)
    run_until(sender_for(hooked, hooked_db), lambda: states(hooked_db, job_id) == ["delivered"] * 3)
    got = receiver.deliveries
    assert [d.verified(secret)["type"] for d in got] == ["job.queued", "job.started", "job.succeeded"]
    assert got[-1].verified(secret)["data"]["lora_path"] == "/o/x.safetensors"
    with pytest.raises(WebhookVerificationError):
        got[0].verified(new_secret())  # another secret does not verify it
    with pytest.raises(WebhookVerificationError):  # the id is signed: another one does not verify
        Delivery({**got[0].headers, "webhook-id": "msg_forged"}, got[0].body, 0).verified(secret)


def test_two_active_secrets_sign_every_request_so_either_verifies_while_rotating(hooked, hooked_db, receiver,
                                                                                 secret, tmp_path):
    new = new_secret()
    rotated = replace(hooked, webhook_secret_file=write_secrets(tmp_path / "rotating", new, secret))
    job_id = a_finished_job(hooked_db)
    run_until(sender_for(rotated, hooked_db), lambda: states(hooked_db, job_id) == ["delivered"] * 3)
    for delivered in receiver.deliveries:
        assert delivered.verified(new) == delivered.verified(secret)
        assert len(delivered.headers["webhook-signature"].split(" ")) == 2


def test_a_receiver_that_fails_three_times_gets_the_event_once_it_recovers(hooked, hooked_db, receiver):
    receiver.script = [Answer(500), Answer(500), Answer(503)]
    job_id = a_finished_job(hooked_db)
    run_until(sender_for(hooked, hooked_db), lambda: states(hooked_db, job_id) == ["delivered"] * 3)
    ids = [d.event_id for d in receiver.deliveries]
    assert ids[:4] == [ids[0]] * 4 and len(set(ids)) == 3  # the first event four times, same id; then the rest
    with hooked_db.reading() as d:
        first = outbox.deliveries(d, job_id)[0]
    assert [a["status_code"] for a in first["attempts"]] == [500, 500, 503, 200]
    assert all(a["latency_ms"] is not None and a["finished_at"] for a in first["attempts"])


def test_retry_after_is_honoured(hooked, hooked_db, receiver):
    receiver.script = [Answer(429, {"Retry-After": "120"})]
    job_id = a_finished_job(hooked_db)
    sender = sender_for(hooked, hooked_db)
    before = utcnow()
    sender.cycle()
    with hooked_db.reading() as d:
        head = outbox.deliveries(d, job_id)[0]
    assert head["state"] == "retrying" and head["next_attempt_at"] >= iso_utc(before + timedelta(seconds=119))
    assert sender.cycle() == 0  # nothing else of the job goes before it: order per job


def test_410_gone_gives_the_event_up_at_once_and_the_job_goes_on(hooked, hooked_db, receiver):
    receiver.script = [Answer(410)]
    job_id = a_finished_job(hooked_db)
    run_until(sender_for(hooked, hooked_db), lambda: "pending" not in states(hooked_db, job_id))
    assert states(hooked_db, job_id) == ["given_up", "delivered", "delivered"]
    assert len(receiver.deliveries) == 3


def test_an_event_past_its_give_up_age_is_given_up_without_a_request(hooked, hooked_db, receiver):
    job_id = a_finished_job(hooked_db, give_up_s=0.2)
    time.sleep(0.3)
    sender_for(hooked, hooked_db).cycle()
    assert states(hooked_db, job_id)[0] == "given_up" and receiver.deliveries == []


def test_a_redirect_is_an_answer_not_a_new_target(hooked, hooked_db, receiver):
    other = []

    class Elsewhere(threading.Thread):
        def run(self) -> None:
            conn, _ = listener.accept()
            other.append(conn.recv(65536))
            conn.close()

    listener = socket.create_server(("127.0.0.1", 0))
    Elsewhere(daemon=True).start()
    receiver.script = [Answer(307, {"Location": f"http://127.0.0.1:{listener.getsockname()[1]}/"})]
    job_id = a_finished_job(hooked_db)
    sender_for(hooked, hooked_db).cycle()
    with hooked_db.reading() as d:
        head = outbox.deliveries(d, job_id)[0]
    assert head["state"] == "retrying" and "redirect" in head["last_error"]
    time.sleep(0.2)
    assert other == []
    listener.close()


def test_the_answer_is_read_at_most_64_kib_and_a_silent_receiver_times_out():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def endless() -> None:  # promises 10 MB, sends 100 KiB, then never ends the body
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\n\r\n" + b"x" * 100_000)
        time.sleep(5)
        conn.close()

    threading.Thread(target=endless, daemon=True).start()
    started = time.monotonic()
    answer = delivery.post(f"http://127.0.0.1:{port}/", b"{}", {}, connect_timeout_s=1, read_timeout_s=3)
    assert answer.delivered and time.monotonic() - started < 2  # it stopped reading at 64 KiB

    def silent() -> None:
        conn, _ = listener.accept()
        time.sleep(3)
        conn.close()

    threading.Thread(target=silent, daemon=True).start()
    answer = delivery.post(f"http://127.0.0.1:{port}/", b"{}", {}, connect_timeout_s=1, read_timeout_s=0.5)
    assert answer.status is None and answer.error == "timed out"
    listener.close()


def test_retry_after_may_be_a_date_and_backoff_grows_with_jitter():
    now = utcnow()
    stamp = (now + timedelta(seconds=90)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert 88 <= delivery.retry_after_s(stamp, now) <= 91
    assert delivery.retry_after_s("soon") is None
    assert [backoff_s(n, lambda: 1.0) for n in (1, 2, 3, 20)] == [1.0, 2.0, 4.0, 3600.0]
    assert 0 < backoff_s(5, lambda: 0.0) < backoff_s(5, lambda: 0.5) < backoff_s(5, lambda: 1.0)


@pytest.mark.parametrize("text, why", [
    ("", "0 secrets"), ("whsec_" + "QUJD" * 2, "at least 24"), ("whsec_!!!", "not whsec_"),
    ("\n".join([new_secret()] * 3), "3 secrets")])
def test_a_secret_file_that_cannot_sign_is_refused(text, why):
    with pytest.raises(ConfigError, match=why):
        signing.parse_secrets(text)


def test_a_secret_readable_by_every_user_or_not_a_file_is_refused(hooked, tmp_path):
    path = write_secrets(tmp_path / "open", new_secret())
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by every user"):
        signing.load_secrets(replace(hooked, webhook_secret_file=path))
    link = tmp_path / "link"
    link.symlink_to(hooked.webhook_secret_file)
    with pytest.raises(ConfigError, match="cannot read"):
        signing.load_secrets(replace(hooked, webhook_secret_file=link))
    with pytest.raises(ConfigError, match="no webhook secret"):
        signing.load_secrets(replace(hooked, webhook_secret_file=None), environ={})

"""The two parsers of a receiver's bytes, property-tested (Hypothesis): Retry-After (delivery.retry_after_s) and
the HTTP answer (delivery.exchange). Whatever a receiver sends, neither raises, a wait is never negative nor
over the documented hour, and an error the outbox keeps is short. Examples per test: the Hypothesis profile's
(tests/conftest.py, HYPOTHESIS_PROFILE; `make fuzz` runs these with a large budget)."""
from __future__ import annotations

import math
import socket
import time
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, strategies as st

from lora_worker.webhooks import delivery
from lora_worker.webhooks.sender import MAX_DELAY_S, retry_wait_s

pytestmark = pytest.mark.fuzz
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)

digits = st.text("0123456789", min_size=1, max_size=30)
unicode_digits = st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=12)
dates = st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)).map(
    lambda d: d.strftime("%a, %d %b ") + f"{d.year:04d}" + d.strftime(" %H:%M:%S GMT"))
retry_afters = st.one_of(st.none(), digits, unicode_digits, dates, st.text(max_size=60),
                         st.text("0123456789 \t,:+-.eE", max_size=40), st.just("9" * 5000))


@given(retry_afters)
def test_retry_after_never_raises_and_is_absent_or_within_the_hour(value):
    seconds = delivery.retry_after_s(value, NOW)
    assert seconds is None or (math.isfinite(seconds) and 0.0 <= seconds <= delivery.MAX_RETRY_AFTER_S)
    if value is not None and value.strip().isascii() and value.strip().isdigit():  # delay-seconds
        assert seconds == min(float(int(value)) if len(value) <= 30 else math.inf, delivery.MAX_RETRY_AFTER_S)


@given(unicode_digits.filter(lambda v: not v.isascii()))
def test_digits_only_in_unicodes_eyes_count_as_absent(value):
    assert delivery.retry_after_s(value, NOW) is None


@given(st.integers(min_value=0, max_value=10 * 3600))
def test_a_date_is_the_seconds_until_it_clamped_to_the_hour(seconds):
    stamp = (NOW + timedelta(seconds=seconds)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert delivery.retry_after_s(stamp, NOW) == min(float(seconds), delivery.MAX_RETRY_AFTER_S)


@given(st.integers(min_value=0, max_value=10**6), st.one_of(st.none(), st.floats(allow_nan=True)),
       st.floats(min_value=0.0, max_value=1.0))
def test_the_wait_before_a_retry_is_positive_and_at_most_the_hour(attempts, asked, jitter):
    wait = retry_wait_s(attempts, asked, lambda: jitter)
    assert 0.0 < wait <= MAX_DELAY_S


# -- the HTTP answer -------------------------------------------------------------------------------------------

header_names = st.sampled_from(["Retry-After", "Content-Length", "Transfer-Encoding", "Connection", "X-Any",
                                "Content-Type"])
header_values = st.one_of(retry_afters.filter(lambda v: v is not None), st.sampled_from(["chunked", "close", "-1"]),
                          st.integers(-5, 10**7).map(str))
latin1 = st.text(st.characters(max_codepoint=255), max_size=40)


@st.composite
def answers(draw) -> bytes:
    """Answers near the shape of HTTP: a status line, headers, maybe chunks, a body; each piece may be off."""
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/1.1 ", "ICY", ""]))
    status = draw(st.one_of(st.integers(0, 1200).map(str), unicode_digits, st.just("²²²")))
    lines = [f"{version} {status} {draw(latin1)}"]
    lines += [f"{draw(header_names)}: {draw(header_values)}" for _ in range(draw(st.integers(0, 6)))]
    lines += [draw(latin1) for _ in range(draw(st.integers(0, 2)))]  # whatever else a broken peer says
    head = "\r\n".join(lines).encode("latin-1", "replace") + b"\r\n\r\n"
    chunks = draw(st.lists(st.tuples(st.sampled_from(["", "0", "5", "zz", "FFFFFFFF", "-1", "3;x=y"]),
                                     st.binary(max_size=20)), max_size=3))
    body = b"".join(size.encode() + b"\r\n" + data + b"\r\n" for size, data in chunks) + draw(st.binary(max_size=200))
    return head + body


@given(st.one_of(st.binary(max_size=2000), answers()))
def test_whatever_the_receiver_answers_the_attempt_is_an_answer(raw):
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(raw)
        theirs.shutdown(socket.SHUT_WR)  # then the receiver hangs up; it never reads our request
        started = time.monotonic()
        answer = delivery.exchange(ours, "receiver.test", None, "/hooks", b"{}", {"webhook-id": "msg_1"},
                                   started + 5.0, started)
    finally:
        ours.close()
        theirs.close()
    assert isinstance(answer, delivery.Answer) and answer.latency_ms >= 0
    if answer.status is None:
        assert answer.error
    else:
        assert 100 <= answer.status <= 999 and (answer.error is None) == answer.delivered
    assert answer.error is None or len(answer.error) <= delivery.MAX_ERROR_CHARS
    assert answer.retry_after_s is None or 0.0 <= answer.retry_after_s <= delivery.MAX_RETRY_AFTER_S

"""Slow clients cannot starve the API: the real gunicorn, with the shipped config, on loopback."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from lora_worker.web.buffered_worker import REQUEST_DEADLINE_S
from tests.helpers.api import TOKEN, bearer
from tests.helpers.service import timed

pytestmark = pytest.mark.slow
DRIPPERS = 16  # of each kind: twice gunicorn's threads in all
DRIP_EVERY_S = 0.25


class Dripper(threading.Thread):
    """A client with no token that sends its request one byte at a time and never finishes it."""

    def __init__(self, port: int, request: bytes, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.request, self.stop = request, stop

    def run(self) -> None:
        try:
            for byte in self.request:
                if self.stop.wait(DRIP_EVERY_S):
                    break
                self.sock.send(bytes([byte]))
        except OSError:
            pass  # the server gave up on us: that is allowed
        finally:
            self.sock.close()


HEADERS = b"POST /train HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Padding: " + b"x" * 400
BODY = (b"POST /train HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 2000\r\n\r\n"
        + b" " * 2000)


def test_sixteen_drippers_of_headers_and_of_bodies_do_not_delay_a_cancel(service, running_job):
    stop = threading.Event()
    drippers = [Dripper(service.port, HEADERS, stop) for _ in range(DRIPPERS)]
    # A body dripper sends its headers at once, so only its body drips.
    drippers += [Dripper(service.port, BODY, stop) for _ in range(DRIPPERS)]
    for d in drippers[DRIPPERS:]:
        d.request = d.request[BODY.index(b"\r\n\r\n") + 4:]
        d.sock.send(BODY[:BODY.index(b"\r\n\r\n") + 4])
    for d in drippers:
        d.start()
    try:
        time.sleep(1.0)  # every dripper has sent part of its request and holds what it can
        assert all(d.is_alive() for d in drippers)
        code, took = timed(service, "GET", "/healthz")
        assert code == 200 and took < 1.0, took
        code, took = timed(service, "POST", f"/train/{running_job}/cancel", headers=bearer(TOKEN))
        assert code == 202 and took < 1.0, took
        code, took = timed(service, "GET", f"/train/{running_job}", headers=bearer(TOKEN))
        assert code == 200 and took < 1.0, took
    finally:
        stop.set()
        for d in drippers:
            d.join(5)


def test_a_request_that_does_not_arrive_whole_in_time_is_answered_408_and_closed(service):
    sock = socket.create_connection(("127.0.0.1", service.port))
    sock.settimeout(REQUEST_DEADLINE_S + 5)
    sock.send(HEADERS[:40])
    started = time.monotonic()
    answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started > REQUEST_DEADLINE_S - 1
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"] == "request_timeout"
    assert sock.recv(4096) == b""  # closed
    sock.close()


def test_a_request_sent_in_pieces_within_the_deadline_is_served_normally(service):
    body = json.dumps({"x": 1}).encode()
    request = (b"POST /train HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nAuthorization: Bearer "
               + TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sock = socket.create_connection(("127.0.0.1", service.port))
    sock.settimeout(10)
    for i in range(0, len(request), 37):
        sock.send(request[i:i + 37])
        time.sleep(0.05)
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 422 ")  # the request arrived whole, and the app judged it
    assert b'"error"' in answer


def test_a_body_declared_over_the_limit_is_a_413_before_it_is_sent(service, migrated):
    sock = socket.create_connection(("127.0.0.1", service.port))
    sock.settimeout(5)
    sock.send(b"POST /train HTTP/1.1\r\nHost: h\r\nContent-Length: " + str(migrated.max_body_bytes + 1).encode()
              + b"\r\n\r\n")
    answer = sock.recv(4096)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"] == "request_entity_too_large"


def test_expect_100_continue_is_answered_so_the_client_sends_its_body(service):
    body = b"{}"
    sock = socket.create_connection(("127.0.0.1", service.port))
    sock.settimeout(5)
    sock.send(b"POST /train HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 2\r\n\r\n")
    assert sock.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
    sock.send(body)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 422 ") and b"100 Continue" not in answer

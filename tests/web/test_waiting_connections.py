"""Slow and many clients cannot starve authorised ones: a request pipelined behind a complete one is buffered
whole before a thread takes it, and idle connections that reconnect as fast as they are dropped never hold the
worker's connection budget. The real gunicorn, with the shipped config, on loopback."""
from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest

from tests.helpers.api import TOKEN, bearer
from tests.helpers.service import timed

DRIP_EVERY_S = 0.25  # as tests/web/test_slow_clients.py drips

pytestmark = pytest.mark.slow
PIPELINERS = 10  # more than gunicorn's 8 threads
IDLE_CLIENTS = 1100  # more than its 1,000 connections
FIRST = b"GET /no-such-route HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # complete: answered 401, kept alive
SECOND = b"GET /no-such-route HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"x" * 400 + b"\r\n\r\n"


class Pipeliner(threading.Thread):
    """Sends one complete request and the start of a second in one write, then drips the rest of the second."""

    def __init__(self, port: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.stop = stop
        self.answered = b""

    def run(self) -> None:
        try:
            self.sock.sendall(FIRST + SECOND[:20])
            self.sock.settimeout(DRIP_EVERY_S)
            for byte in SECOND[20:]:
                if self.stop.is_set():
                    break
                try:
                    self.answered += self.sock.recv(65536)
                except TimeoutError:
                    pass
                self.sock.send(bytes([byte]))
        except OSError:
            pass  # the server gave up on us: that is allowed
        finally:
            self.sock.close()


def test_ten_pipelining_drippers_do_not_time_out_an_authorised_cancel(service, running_job):
    stop = threading.Event()
    pipeliners = [Pipeliner(service.port, stop) for _ in range(PIPELINERS)]
    for p in pipeliners:
        p.start()
    try:
        time.sleep(1.5)  # each first request answered; each second one dripping
        assert all(p.answered.startswith(b"HTTP/1.1 401 ") for p in pipeliners), [p.answered[:20] for p in pipeliners]
        assert all(p.is_alive() for p in pipeliners)
        code, took = timed(service, "POST", f"/train/{running_job}/cancel", headers=bearer(TOKEN))
        assert code == 202 and took < 1.0, (code, took)
        code, took = timed(service, "GET", f"/train/{running_job}", headers=bearer(TOKEN))
        assert code == 200 and took < 1.0, (code, took)
    finally:
        stop.set()
        for p in pipeliners:
            p.join(5)


class Reconnecters(threading.Thread):
    """`n` connections that send nothing and, whenever the server closes one, open it again at once."""

    def __init__(self, port: int, n: int, stop: threading.Event, deadline_s: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.port, self.n, self.stop, self.deadline = port, n, stop, time.monotonic() + deadline_s
        self.selector = selectors.DefaultSelector()
        self.reconnects = 0

    def _connect(self) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", self.port))
        self.selector.register(sock, selectors.EVENT_READ)

    def run(self) -> None:
        for _ in range(self.n):
            self._connect()
        while not self.stop.is_set() and time.monotonic() < self.deadline:  # bounded, whatever happens
            for key, _ in self.selector.select(0.2):
                sock = key.fileobj
                try:
                    data = sock.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.selector.unregister(sock)
                    sock.close()
                    self._connect()
                    self.reconnects += 1
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


def test_eleven_hundred_idle_reconnecting_connections_do_not_delay_an_authorised_get(service, running_job):
    stop = threading.Event()
    idle = Reconnecters(service.port, IDLE_CLIENTS, stop)
    idle.start()
    try:
        time.sleep(3.0)  # every idle connection is open, or waiting to be accepted
        for _ in range(3):
            code, took = timed(service, "GET", f"/train/{running_job}", headers=bearer(TOKEN))
            assert code == 200 and took < 1.0, (code, took, idle.reconnects)
            time.sleep(0.5)
        assert idle.is_alive()  # they were still at it
    finally:
        stop.set()
        idle.join(10)

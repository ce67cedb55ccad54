"""gunicorn's gthread worker, buffering each request whole before a thread takes it (as a front proxy would).

The stock gthread worker hands a connection to a thread as soon as the first bytes arrive, and the thread then
reads the rest of the headers and the body blocking. A client that drips its request a byte at a time holds a
thread for as long as it likes: eight of them held all eight threads, and a cancel waited behind them.

Here the worker's event loop reads every request, without blocking, until its headers and its whole body
(Content-Length, at most `max_body_bytes`) are in memory; only then does a thread parse and serve it, from that
buffer, in microseconds. A request that is not whole within REQUEST_DEADLINE_S is answered 408 and closed; one
that declares a body over `max_body_bytes` is answered 413 at once; a chunked body (which no client of this API
sends) 411. Slow clients then cost a socket and a buffer each, never a thread.

A client may send its next request on the same connection before the first is answered (HTTP pipelining):
what gunicorn read ahead is then buffered here the same way, so a complete request followed by a dripped one
never leaves a thread waiting on the second.

Waiting connections (being buffered, or kept alive between requests) have a budget: in time, the deadline
above and gunicorn's `keepalive`; in number, `worker_connections` less twice the threads. When one more is
accepted over that number, the one that has waited longest is closed: idle clients that reconnect as fast as
they are dropped cannot hold every connection, so the worker never stops accepting, and a client that sends
its request whole (every authorised one) is read and served at once, never queued behind them.

Relies on gthread's internals (TConn, the poller, enqueue_req) of the pinned gunicorn (setup.cfg).
"""
from __future__ import annotations

import json
import re
import selectors
import socket
import time
from collections import deque
from functools import partial
from typing import Any

from gunicorn.workers.gthread import ThreadWorker, TConn

from lora_worker.config import load_settings

REQUEST_DEADLINE_S = 10.0  # from the first byte (or the accept) to the end of the body
MAX_HEADER_BYTES = 64 * 1024  # beyond gunicorn's own limits: handed over whole, gunicorn refuses it
READ_BYTES = 64 * 1024
HEADER_END = b"\r\n\r\n"
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)[ \t]*(?=\r\n)", re.IGNORECASE)
TRANSFER_ENCODING = re.compile(rb"\r\ntransfer-encoding:", re.IGNORECASE)
EXPECT_CONTINUE = re.compile(rb"\r\nexpect:[ \t]*100-continue[ \t]*(?=\r\n)", re.IGNORECASE)


class BufferingThreadWorker(ThreadWorker):
    """gthread, with requests read by the event loop until whole."""

    def init_process(self) -> None:
        self.max_body_bytes = load_settings().max_body_bytes
        self.buffering: deque[TConn] = deque()  # oldest deadline first
        self.waiting_budget = max(1, self.cfg.worker_connections - 2 * self.cfg.threads)
        # With TLS the bytes on the socket are records, not a request: buffer only plain HTTP (this service
        # serves plain HTTP; TLS would be a front proxy's, which buffers requests itself).
        self.buffer_requests = not self.cfg.is_ssl
        super().init_process()

    # -- where connections come from --------------------------------------------------------------------

    def accept(self, listener: socket.socket) -> None:
        if not self.buffer_requests:
            super().accept(listener)
            return
        try:
            client, address = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # as gthread: another worker took it, or the client left
        self.nr_conns += 1
        self._buffer(TConn(self.cfg, client, address, listener.getsockname()))  # TConn makes it non-blocking
        if len(self.buffering) + len(self.keepalived_conns) > self.waiting_budget:
            self._drop_longest_waiting()

    def on_client_socket_readable(self, conn: TConn, client: socket.socket) -> None:
        """A kept-alive connection has a next request: buffer it like a new one."""
        if not self.buffer_requests:
            super().on_client_socket_readable(conn, client)
            return
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._buffer(conn)

    def finish_request(self, conn: TConn, fs: Any) -> None:
        """A request served: if its client pipelined more behind it, buffer that like a new request."""
        if self.buffer_requests and self.alive and _kept_alive(fs) and conn.parser is not None:
            ahead = conn.parser.unreader.take_buffered()
            if ahead:
                conn.sock.setblocking(False)
                self._buffer(conn, ahead)
                return
        super().finish_request(conn, fs)

    def _buffer(self, conn: TConn, ahead: bytes = b"") -> None:
        conn.prebuffer = bytearray()
        conn.continued = False
        conn.timeout = time.monotonic() + REQUEST_DEADLINE_S
        self.buffering.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_buffering_readable, conn))
        if ahead:  # already read: it may be whole, and the socket may never be readable again
            self._received(conn, ahead)

    def _drop_longest_waiting(self) -> None:
        """Over the budget of waiting connections: close the one that has waited longest (kept alive, or
        still sending its request), as its timeout would have, only sooner."""
        keepalive_s = self.cfg.keepalive
        kept = self.keepalived_conns[0] if self.keepalived_conns else None
        buffering = self.buffering[0] if self.buffering else None
        if kept is not None and (buffering is None
                                 or kept.timeout - keepalive_s <= buffering.timeout - REQUEST_DEADLINE_S):
            self.keepalived_conns.popleft()
            try:
                self.poller.unregister(kept.sock)
            except (KeyError, ValueError, OSError):
                pass
            self._close(kept)
        elif buffering is not None:
            self._drop(buffering)

    # -- reading, on the event loop -----------------------------------------------------------------------

    def _on_buffering_readable(self, conn: TConn, client: socket.socket) -> None:
        try:
            data = client.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        self._received(conn, data)

    def _received(self, conn: TConn, data: bytes) -> None:
        conn.prebuffer += data
        verdict = self._verdict(conn)
        if verdict == "wait":
            return
        self._stop_buffering(conn)
        if verdict == "whole":
            conn.data_ready = True
            self.enqueue_req(conn)
        elif verdict == "too_large":
            self._answer(conn, 413, "request_entity_too_large",
                         f"The body is larger than the limit of {self.max_body_bytes} bytes.")
        else:
            self._answer(conn, 411, "length_required", "A body must come with a Content-Length header.")

    def _verdict(self, conn: TConn) -> str:
        buf = conn.prebuffer
        end = buf.find(HEADER_END)
        if end < 0:
            return "whole" if len(buf) > MAX_HEADER_BYTES else "wait"
        head = bytes(buf[:end + 2])
        if TRANSFER_ENCODING.search(head):
            return "chunked"
        length = CONTENT_LENGTH.search(head)
        declared = int(length[1]) if length else 0
        if declared > self.max_body_bytes:
            return "too_large"
        if len(buf) - end - len(HEADER_END) >= declared:
            return "whole"
        if not conn.continued and EXPECT_CONTINUE.search(head):
            # The client waits for this before it sends the body; gunicorn would send it only once a thread
            # reads the body. Sent here, and the header removed so that it is not sent twice.
            conn.continued = True
            self._send_now(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
            match = EXPECT_CONTINUE.search(head)
            assert match is not None
            del buf[match.start() + 2:match.end() + 2]
        return "wait"

    def handle(self, conn: TConn) -> Any:
        """In a thread: serve the buffered request (from memory; the socket holds nothing more of it)."""
        prebuffer = conn.__dict__.pop("prebuffer", None)
        if prebuffer is not None:
            conn.sock.setblocking(True)
            conn.init()
            conn.parser.unreader.unread(bytes(prebuffer))
        return super().handle(conn)

    # -- endings ------------------------------------------------------------------------------------------

    def murder_pending(self) -> None:
        super().murder_pending()
        now = time.monotonic()
        while self.buffering and self.buffering[0].timeout <= now:
            conn = self.buffering[0]
            self._stop_buffering(conn)
            self._answer(conn, 408, "request_timeout",
                         f"The request did not arrive whole within {REQUEST_DEADLINE_S:g} seconds.")

    def _stop_buffering(self, conn: TConn) -> None:
        self.buffering.remove(conn)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _answer(self, conn: TConn, status: int, code: str, message: str) -> None:
        """A short JSON error in the one error shape (`retryable` from the catalogue), sent without blocking
        (it fits the socket buffer), then close."""
        from lora_worker.web.errors import BY_CODE  # the app's module: loaded in this process already

        body = json.dumps({"error": code, "message": message, "status": status,
                           "retryable": BY_CODE[code].retryable}).encode()
        reason = {408: "Request Timeout", 411: "Length Required", 413: "Content Too Large"}[status]
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        self._send_now(conn, head + body)
        self._close(conn)

    def _drop(self, conn: TConn) -> None:
        self._stop_buffering(conn)
        self._close(conn)

    def _close(self, conn: TConn) -> None:
        self.nr_conns -= 1
        try:
            conn.sock.close()
        except OSError:
            pass

    @staticmethod
    def _send_now(conn: TConn, data: bytes) -> None:
        try:
            conn.sock.send(data)
        except OSError:
            pass


def _kept_alive(fs: Any) -> bool:
    """Whether the thread's answer kept the connection open for another request."""
    try:
        return not fs.cancelled() and fs.result() is True
    except Exception:  # noqa: BLE001 - gunicorn's own finish_request handles a failed request
        return False

"""The real webhook sender, killed by SIGKILL at one named point of its first delivery.

Usage: python -m tests.chaos.faulty_sender, with LORA_WORKER_SETTINGS (the settings as JSON, as the web hands them) and
KILL_AT=<point> in the environment:
  before_post   the attempt is committed as started; the request never leaves
  after_post    the receiver answered 2xx; the answer is never written
  in_settle     inside the transaction that writes the answer, before its commit

Or, with `--ready-fd=N` (as the web starts a sender: detached, host/detach.py), the real sender whose every
close of its ready pipe is followed by a pause of PAUSE_S: what its starter sees once the pipe speaks is what
it must be able to see however long the sender then takes (a loaded machine may deschedule it that long).
"""
from __future__ import annotations

import os
import signal
import sys
import time

from lora_worker.host.detach import detached_main
from lora_worker.ledger import outbox
from lora_worker.webhooks import process, sender

POINT = os.environ.get("KILL_AT", "")
PAUSE_S = 2.0


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    real_post, real_delivered = sender.delivery.post, outbox.delivered

    def post(*args, **kwargs):  # type: ignore[no-untyped-def]
        if POINT == "before_post":
            die()
        answer = real_post(*args, **kwargs)
        if POINT == "after_post":
            die()
        return answer

    def delivered(db, event_pk):  # type: ignore[no-untyped-def]
        real_delivered(db, event_pk)
        if POINT == "in_settle":
            die()

    # `post` is a default bound when Sender was defined: the faulty one goes in through the constructor.
    original_init = sender.Sender.__init__

    def init(self, settings, db, keys, **kwargs):  # type: ignore[no-untyped-def]
        original_init(self, settings, db, keys, **{**kwargs, "post": post})

    sender.Sender.__init__ = init  # type: ignore[method-assign]
    outbox.delivered = delivered
    _unread, write_end = os.pipe()  # the handshake has no reader here
    return process.serve(write_end)


def serve(ready_fd: int) -> int:
    real_close = os.close

    def close(fd: int) -> None:
        real_close(fd)
        if fd == ready_fd:
            time.sleep(PAUSE_S)

    os.close = close
    return process.serve(ready_fd)


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit(detached_main(sys.argv[1:], "usage: python -m tests.chaos.faulty_sender [--ready-fd=N]",
                               "tests.chaos.faulty_sender"))
    sys.exit(main())

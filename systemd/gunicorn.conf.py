"""gunicorn settings for lora-worker (the dev `make run` and the systemd unit use this same file).

One worker process: the one-active-job rule lives in SQLite, but a single process keeps the ledger engine and
NVML handle simple. gthread with several threads so a long-polling client never blocks a cancel, in the
variant that reads each request whole on its event loop before a thread takes it: a client that drips its
headers or body holds a socket, never a thread (lora_worker/web/buffered_worker.py).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

from lora_worker.config import load_settings

# The `bind` setting (config file or LORA_WORKER_BIND); a --bind on the command line still wins.
bind = [address.strip() for address in load_settings().bind.split(",") if address.strip()]
workers = 1
worker_class = "lora_worker.web.buffered_worker.BufferingThreadWorker"
threads = 8
# At most this many connections at once; those waiting (being read, or kept alive) get all but twice the threads,
# and past that the one waiting longest is closed (buffered_worker.py): idle clients never stop the accept.
worker_connections = 1000
# No preload: the app (and its SQLite engine) is built in the worker after fork, never in the master.
preload_app = False
timeout = 30
graceful_timeout = 20  # below the unit's TimeoutStopSec
keepalive = 5
accesslog = "-"
errorlog = "-"
# Never log request headers: the Authorization header carries the API token.
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss'
# No admin socket in $HOME: nothing uses it, and it is one more way in (gunicorn 25.1 and later open one by default).
control_socket_disable = True


def post_fork(server: Any, worker: Any) -> None:
    """Tell the app, built in this worker after the fork, the addresses gunicorn really listens on, and keep
    glibc to a few malloc arenas before the worker starts its threads.

    The app refuses to run without a token unless every one of them is loopback; reading `bind` from the
    settings alone would miss a --bind given on the command line.
    """
    os.environ["LORA_WORKER_BIND"] = ",".join(server.cfg.bind)
    limit_malloc_arenas(MALLOC_ARENAS)


# glibc gives each thread that allocates its own arena (up to 8 per core), each keeping freed memory: with 8
# request threads and 1000 long pollers the worker held ~7 MiB more than with one (77.7 against 70.4 MiB).
# The threads run Python under one GIL, so they hardly ever contend for malloc's lock.
MALLOC_ARENAS = 2
M_ARENA_MAX = -8  # malloc.h


def limit_malloc_arenas(arenas: int) -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, arenas)
    except (OSError, AttributeError):  # not glibc: nothing to limit
        pass

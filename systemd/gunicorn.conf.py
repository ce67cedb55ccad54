"""gunicorn settings for lora-worker (the dev `make run` and the systemd unit use this same file).

One worker process: the one-active-job rule lives in SQLite, but a single process keeps the ledger engine and
NVML handle simple. gthread with several threads so a slow or long-polling client never blocks a cancel.
"""
import os

bind = os.environ.get("LORA_WORKER_BIND", "127.0.0.1:8203")  # the unit passes --bind 0.0.0.0:8203
workers = 1
worker_class = "gthread"
threads = 8
# No preload: the app (and its SQLite engine) is built in the worker after fork, never in the master.
preload_app = False
timeout = 30
graceful_timeout = 20  # below the unit's TimeoutStopSec
keepalive = 5
accesslog = "-"
errorlog = "-"
# Never log request headers: the Authorization header carries the API token.
access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss'

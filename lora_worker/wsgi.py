"""gunicorn target: `gunicorn -c systemd/gunicorn.conf.py lora_worker.wsgi:app` (one worker, no preload)."""
from __future__ import annotations

from lora_worker import create_app
from lora_worker.web.app import start_reconcile_timer

app = create_app(deep_health=True)  # the deep checks, once, in the background, for /healthz?deep=1
start_reconcile_timer(app)  # reconcile also runs between requests, never from /healthz

"""gunicorn target: `gunicorn -c systemd/gunicorn.conf.py lora_worker.wsgi:app` (one worker, no preload)."""
from __future__ import annotations

from lora_worker import create_app

app = create_app(deep_health=True)  # the deep checks, once, in the background, for /healthz?deep=1

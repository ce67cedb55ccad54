"""The GPU check's gunicorn target: lora_worker/wsgi.py's app (deep checks at start-up, the reconcile timer), built
from the check's own Settings instead of the environment.

The check's settings hold what no config file or variable may set (`rig_tier_sizes`: a few dozen steps, a sample
pass's few sampler steps), so the check writes them as the JSON a supervisor is handed (config.settings_to_json) to
the file named by LW_GPU_CHECK_SETTINGS, and this module reads it. Everything else is the service as `make run`
starts it: the same gunicorn config (systemd/gunicorn.conf.py), the same app factory, the real detached supervisor
per job.
"""
from __future__ import annotations

import os
from pathlib import Path

from bench.gpu_check.service import DEEP_ENV, SETTINGS_FILE_ENV
from lora_worker import create_app
from lora_worker.config import settings_from_json
from lora_worker.web.app import start_reconcile_timer

_settings = settings_from_json(Path(os.environ[SETTINGS_FILE_ENV]).read_text())
# gunicorn.conf.py's post_fork says where gunicorn really listens: the app insists on loopback without a token.
_settings = _settings.with_overrides(bind=os.environ.get("LORA_WORKER_BIND", _settings.bind))
# The first service of a check runs the deep checks and the check reads them; the later ones, one per run, leave them
# out: their probe (the trainer's torch, in the sandbox) would hold the GPU while the run's job is admitted.
app = create_app(_settings, deep_health=os.environ.get(DEEP_ENV) != "0")
start_reconcile_timer(app)

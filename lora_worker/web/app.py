"""The application factory: settings, the token rule, a checked ledger, the start-up reconcile, blueprints,
auth, error handlers."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from flask import Flask, request

from lora_worker.web import auth, deliveries, gpu, health, metrics, openapi, samples, train
from lora_worker.web.errors import register_error_handlers
from lora_worker.config import Settings, load_settings
from lora_worker.errors import LoraWorkerError
from lora_worker.host.nvml import Nvml, make_nvml
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import check_ledger, prepare_state_dir
from lora_worker.dispatch import auto_resume
from lora_worker.reconcile import reconcile
from lora_worker.web.service import RECONCILE_EVERY_S, Worker
from lora_worker.webhooks.process import ensure_sender
from lora_worker.backends import Backend, backend_for

log = logging.getLogger(__name__)


def build_app(config: Settings | dict[str, Any] | None = None, *, nvml: Nvml | None = None,
              launch: Callable[[int, Settings], None] | None = None, backend: Backend | None = None,
              deep_health: bool = False) -> Flask:
    """Build the app. Nothing here runs at import time, and no connection is opened before this call.

    Jobs run on `backend` (default: the one the settings ask for); `launch` alone keeps that backend but
    starts runs with it instead (a test's recorder). `deep_health`: run the deep checks (readiness.py) now, in
    the background, for /healthz?deep=1: the service does (wsgi.py); a test asks when it wants them."""
    settings = config if isinstance(config, Settings) else load_settings().with_overrides(**(config or {}))
    token = auth.load_token(settings)
    auth.require_token_off_loopback(settings, token)
    prepare_state_dir(settings)
    check_ledger(settings)
    db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s)
    backend = backend if backend is not None else backend_for(settings, launch)
    worker = Worker(settings=settings, db=db,
                    nvml=nvml if nvml is not None else make_nvml(settings.nvml_timeout_s, settings.nvml_fake_file),
                    backend=backend)
    start_up_reconcile(worker)
    ensure_sender(settings)  # events a crash left in the outbox go out without waiting for a new job

    app = Flask(__name__, static_folder=None)  # an API: no /static route
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["lora_worker"] = worker
    app.extensions["lora_worker_metrics"] = metrics.registry_for(worker)
    for blueprint in (train.bp, samples.bp, deliveries.bp, gpu.bp, health.bp, metrics.bp, openapi.bp):
        app.register_blueprint(blueprint)
    auth.protect(app, token)
    reconcile_on_requests(app)
    register_error_handlers(app)
    # In the background (a start must not wait for the trainer's torch import), and only once the routes are
    # compiled: Python 3.11's AST builder keeps one recursion counter per interpreter, so a traceback the checks'
    # thread formats (its carets come from ast.parse) beside werkzeug compiling the rules in this one made the
    # next compile fail "AST constructor recursion depth mismatch" (CPython gh-106905; a test's create_app, CI).
    if deep_health:
        worker.deep_health.start()
    return app


def start_up_reconcile(worker: Worker) -> None:
    """Reconcile, then follow up each job a reboot cut off. Whatever it meets (a ledger still busy, a state file
    nobody foresaw), the service starts: the failure is logged with its traceback, and the timed reconcile and the
    requests' try again (each job's own trouble is contained to that job: reconcile.py, auto_resume.py)."""
    try:
        for action in reconcile(worker.db, worker.settings, actor="startup", backend=worker.backend):
            log.warning("start-up reconcile: job %s → failed (%s)", action.job_id, action.failure_class.value,
                        extra={"job": action.job_id})
        for resumed in auto_resume.follow_up(worker.dispatcher):  # after a reboot: resumed once, or marked resumable
            log.warning("start-up reconcile: job %s resumes a job the reboot cut off", resumed, extra={"job": resumed})
    except Exception:  # noqa: BLE001 - the service starts whatever the ledger or the train root holds
        log.exception("start-up reconcile failed; the service starts, and the next reconcile tries again")


def reconcile_on_requests(app: Flask) -> None:
    """An authenticated request (one past auth.protect's check) reconciles first, at most every few seconds;
    an open one (/healthz) never does."""
    @app.before_request
    def _reconcile() -> None:
        if request.endpoint is None or request.endpoint in auth.OPEN_ENDPOINTS:
            return
        try:
            app.extensions["lora_worker"].reconcile_if_due()
        except LoraWorkerError as exc:  # a busy or replaced ledger: the route's own work decides its answer
            log.warning("reconcile before %s skipped: %s", request.endpoint, exc.message)
        except Exception:  # noqa: BLE001 - a reconcile's bug is not this request's: its route answers
            log.exception("reconcile before %s failed; the request goes on", request.endpoint)


def start_reconcile_timer(app: Flask, every_s: float = RECONCILE_EVERY_S) -> threading.Event:
    """Reconcile every `every_s` in a daemon thread of the web process; set the returned event to stop it.

    A thread here, not a systemd timer: reconcile needs the service's own backend (on Slurm it restarts the
    job's poller, which the web process owns), and `make run` and the demo have no systemd. gunicorn runs one
    worker, so there is one timer. Errors are logged and the next round tries again."""
    worker: Worker = app.extensions["lora_worker"]
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                for action in reconcile(worker.db, worker.settings, actor="timer", backend=worker.backend):
                    log.warning("timed reconcile: job %s → failed (%s)", action.job_id,
                                action.failure_class.value, extra={"job": action.job_id})
            except Exception:  # noqa: BLE001 - a full disk or a locked ledger now; the next round retries
                log.exception("timed reconcile failed")

    threading.Thread(target=loop, daemon=True, name="reconcile-timer").start()
    return stop

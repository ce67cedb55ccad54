"""/healthz is open, so it only reads: no reconcile, no ledger write, no signal, no backend query. Reconcile runs
at start-up, from the web process's timer, and on authenticated requests at most every few seconds."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lora_worker import create_app
from lora_worker.host import processes
from lora_worker.ledger import repository as repo
from lora_worker.web import service
from lora_worker.web.app import start_reconcile_timer
from tests.helpers import pid_alive, wait_for
from tests.helpers.ledger import running_job


@pytest.fixture
def ours():
    """A live process that a running row names as its trainer, provably (pid and start ticks): reconcile kills it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def orphaned(migrated, ours):
    """An app whose ledger holds a running job whose supervisor is gone, and whose trainer still runs."""
    app = create_app(migrated, launch=lambda *_: None)
    db = app.extensions["lora_worker"].db
    job_id = running_job(db, boot_id=processes.boot_id(), supervisor_pid=999_999, trainer_pid=ours.pid,
                         trainer_start_ticks=processes.start_ticks(ours.pid))
    yield app, job_id
    db.dispose()


def ledger_state(path: Path) -> tuple[str, ...]:
    """Every byte of the ledger and its WAL: a write anywhere changes one of them."""
    return tuple(hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else "absent"
                 for p in (path, Path(f"{path}-wal")))


@pytest.mark.slow
def test_healthz_writes_nothing_and_signals_nothing(orphaned, migrated, ours, monkeypatch):
    app, job_id = orphaned
    signals: list[tuple] = []
    for name in ("kill", "killpg"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _n=name: signals.append((_n, *a)) or _real(*a))
    backend = app.extensions["lora_worker"].backend
    asked: list[int] = []
    real_attended = backend.attended
    monkeypatch.setattr(backend, "attended", lambda job, settings: asked.append(job) or real_attended(job, settings))
    before = ledger_state(migrated.database_path)
    client = app.test_client()
    for _ in range(3):
        response = client.get("/healthz")
        assert response.status_code == 200 and response.get_json()["active_job_id"] == job_id
    assert ledger_state(migrated.database_path) == before
    assert signals == [] and asked == []  # no kill, no "is its supervisor alive?" (squeue on Slurm)
    assert pid_alive(ours.pid)
    with app.app_context():
        assert repo.get_job(app.extensions["lora_worker"].db, job_id).status == "running"


@pytest.mark.slow
def test_an_authenticated_request_reconciles_at_most_every_few_seconds(orphaned, ours, monkeypatch):
    app, job_id = orphaned
    worker = app.extensions["lora_worker"]
    runs: list[float] = []
    real = worker.reconcile_active
    monkeypatch.setattr(worker, "reconcile_active", lambda: runs.append(time.monotonic()) or real())
    assert worker.reconcile_if_due() is True and len(runs) == 1
    assert repo.get_job(worker.db, job_id).status == "failed"
    assert worker.reconcile_if_due() is False and len(runs) == 1  # within RECONCILE_MIN_GAP_S
    monkeypatch.setattr(service, "RECONCILE_MIN_GAP_S", 0.0)
    app.test_client().get("/openapi.json")  # any authenticated route reconciles first
    assert len(runs) == 2


@pytest.mark.slow
def test_the_timer_reconciles_without_any_request(orphaned, ours):
    app, job_id = orphaned
    stop = start_reconcile_timer(app, every_s=0.1)
    try:
        db = app.extensions["lora_worker"].db
        wait_for(lambda: repo.get_job(db, job_id).status == "failed", timeout=10, what="the timed reconcile")
        assert repo.job_events(db, job_id)[-1].actor == "timer"
        wait_for(lambda: not pid_alive(ours.pid) or ours.poll() is not None, timeout=10, what="the leftover killed")
    finally:
        stop.set()
        # Its thread may be inside a reconcile still: once the test has ended it would log to pytest's closed
        # capture ("--- Logging error ---" in CI's output) and act on a tmp dir being removed.
        for thread in threading.enumerate():
            if thread.name == "reconcile-timer":
                thread.join(timeout=10)
    assert ours.returncode in (None, -signal.SIGTERM, -signal.SIGKILL)


def test_a_reconcile_that_cannot_run_does_not_fail_a_route_that_needs_no_ledger(client, migrated):
    migrated.database_path.unlink()  # the ledger replaced under the service: reconcile raises LedgerReplaced
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/train/1").get_json()["error"] == "ledger_replaced"  # a route that reads it says so

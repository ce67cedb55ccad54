"""Fixtures: a fresh state dir, ledger and fake trainer installation per test; the app → client chain."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from lora_worker.config import Settings
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import upgrade
from tests.helpers import Host, Launches, make_host


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return make_host(tmp_path)


@pytest.fixture
def settings(host: Host) -> Settings:
    return host.settings


@pytest.fixture
def migrated(settings: Settings) -> Settings:
    upgrade(settings.database_path)
    return settings


@pytest.fixture
def db(migrated: Settings):
    database = Database.open(migrated.database_path)
    yield database
    database.dispose()


@pytest.fixture
def app(migrated: Settings):
    from lora_worker import create_app

    application = create_app(migrated)
    application.config["TESTING"] = True
    yield application
    application.extensions["lora_worker"].db.dispose()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def launches() -> Launches:
    return Launches()


@pytest.fixture
def api(migrated: Settings, launches: Launches):
    """A client of an app whose supervisor launcher only records: validation and dispatch without processes."""
    from lora_worker import create_app

    application = create_app(migrated, launch=launches)
    yield application.test_client()
    application.extensions["lora_worker"].db.dispose()


@pytest.fixture
def nvml(settings: Settings):
    from lora_worker.gpu.nvml import FakeNvml

    assert settings.nvml_fake_file is not None
    return FakeNvml.from_file(settings.nvml_fake_file)


@pytest.fixture(autouse=True)
def _no_leftover_processes(tmp_path: Path):
    """Every process a test started under its tmp dir is gone afterwards (and killed if not)."""
    yield
    marker = str(tmp_path)
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or ())
            environ = proc.info["environ"] or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.pid != os.getpid() and (marker in cmdline or marker in environ.get("LORA_WORKER_SETTINGS", "")):
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

"""Fixtures of a worker with a webhook target: a real receiver on loopback, a secret file, and the host's
settings pointing at them (tests/webhooks and the chaos suite's kill points; tests/conftest.py loads them)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker.config import Settings
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import upgrade
from lora_worker.webhooks.process import SYSTEMD_ENV, stop_sender
from tests.helpers import Host
from tests.webhooks.receiver import Receiver, new_secret, write_secrets


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver().start()
    yield server
    server.stop()


@pytest.fixture
def secret() -> str:
    return new_secret()


@pytest.fixture
def hooked(host: Host, receiver: Receiver, secret: str, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    """Migrated settings with webhooks on: every event type, progress at most every 0.5 s. The web starts the
    sender here as in a checkout, even when the tests themselves run in a systemd unit (a CI runner's)."""
    monkeypatch.delenv(SYSTEMD_ENV, raising=False)
    settings = replace(host.settings, webhook_url=receiver.url,
                       webhook_secret_file=write_secrets(tmp_path / "webhook_secret", secret),
                       webhook_progress_interval_s=0.5, webhook_connect_timeout_s=1.0, webhook_read_timeout_s=2.0)
    upgrade(settings.database_path)
    yield settings
    stop_sender(settings)


@pytest.fixture
def hooked_db(hooked: Settings) -> Iterator[Database]:
    database = Database.open(hooked.database_path)
    yield database
    database.dispose()


@pytest.fixture
def client_for(launches):
    """A test client of an app on `settings` whose launcher only records (no supervisor runs)."""
    from lora_worker import create_app

    apps = []

    def make(settings: Settings):
        application = create_app(settings, launch=launches)
        apps.append(application)
        return application.test_client()

    yield make
    for application in apps:
        application.extensions["lora_worker"].db.dispose()

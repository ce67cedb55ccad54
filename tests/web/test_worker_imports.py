"""The web worker holds no module it does not need to serve: its resident memory is its imports (issue #18:
under 80 MiB with 1000 pollers). alembic is for migrating, apispec for the rarely fetched /openapi.json."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lora_worker.config import REPO_ROOT
from tests.helpers.service import settings_env

pytestmark = pytest.mark.slow  # every test here starts a real process

# alembic (and mako, which it loads) ~10 MiB; apispec and its YAML support ~1 MiB.
NOT_AT_START = ("alembic", "mako", "apispec", "apispec_webframeworks", "yaml", "pygments")

BUILD_THEN_LIST = """
import json, sys
from lora_worker import create_app
app = create_app()
before = sorted({m.split('.')[0] for m in sys.modules})
assert app.test_client().get('/openapi.json').status_code == 200
after = sorted({m.split('.')[0] for m in sys.modules})
print(json.dumps([before, after]))
"""


def test_a_started_worker_has_not_loaded_alembic_nor_apispec_until_the_document_is_asked_for(migrated):
    out = subprocess.run([sys.executable, "-c", BUILD_THEN_LIST], check=True, capture_output=True, text=True,
                         cwd=REPO_ROOT, env={**settings_env(migrated), "PATH": "/usr/bin:/bin"}).stdout
    at_start, after_openapi = (set(names) for names in json.loads(out.splitlines()[-1]))
    assert {"flask", "sqlalchemy", "lora_worker"} <= at_start
    assert not set(NOT_AT_START) & at_start
    assert "apispec" in after_openapi  # the document is still built, on its first request

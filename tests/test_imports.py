"""The supervisor's side of the package stays free of the web stack: Flask, apispec and prometheus-client
load only in the web process."""
from __future__ import annotations

import subprocess
import sys

from lora_worker.config import REPO_ROOT

SUPERVISOR_SIDE = ("lora_worker.supervisor.__main__", "lora_worker.supervisor.main", "lora_worker.supervisor.runner",
                   "lora_worker.ledger.repository", "lora_worker.ledger.reconcile", "lora_worker.progress.logfile",
                   "lora_worker.config", "lora_worker.retention")
WEB_ONLY = ("flask", "werkzeug", "apispec", "apispec_webframeworks", "prometheus_client")


def test_the_supervisor_never_imports_flask_apispec_or_prometheus_client():
    code = (f"import importlib, sys\nfor m in {SUPERVISOR_SIDE!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in {WEB_ONLY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert result.stdout.strip() == "[]"

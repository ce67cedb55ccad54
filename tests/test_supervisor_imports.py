"""The supervisor runs for hours next to the trainer: it loads nothing of the web stack it does not need."""
from __future__ import annotations

import json
import subprocess
import sys

WEB_ONLY = ("flask", "werkzeug", "marshmallow", "apispec", "prometheus_client", "jinja2", "click", "torch")


def test_the_supervisor_entry_modules_import_no_web_framework():
    code = ("import json, sys, lora_worker.supervisor.__main__, lora_worker.supervisor.main; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert "lora_worker" in loaded
    assert not set(WEB_ONLY) & set(loaded)

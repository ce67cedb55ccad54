"""The supervisor runs for hours next to the trainer: it loads nothing of the web stack it does not need."""
from __future__ import annotations

import json
import subprocess
import sys

WEB_ONLY = ("flask", "werkzeug", "marshmallow", "apispec", "prometheus_client", "jinja2", "click", "torch")


def test_the_supervisor_entry_modules_import_no_web_framework():
    # Everything a run loads: main.py imports the ledger and the runner lazily, once it holds the job lock.
    code = ("import json, sys, lora_worker.run.__main__, lora_worker.run.main, "
            "lora_worker.run.runner, lora_worker.ledger.db; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert {"lora_worker", "sqlalchemy", "psutil"} <= set(loaded)
    assert not set(WEB_ONLY) & set(loaded)


def test_the_supervisor_takes_its_job_lock_before_loading_the_ledger():
    # POST /train waits until the supervisor holds the job lock; what main.py imports up front is that wait.
    code = ("import json, sys, lora_worker.run.__main__, lora_worker.run.main; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert "lora_worker" in loaded
    assert not {"sqlalchemy", "psutil"} & set(loaded)

"""The supervisor runs for hours next to the trainer: it loads nothing of the web stack it does not need, no
SQLAlchemy (its ledger is the stdlib sqlite3 path, ledger/supervisor.py: 28 MiB and ~160 ms of its start) and
no psutil, and what only the end of a run uses is not loaded before the trainer starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts a real process

WEB_ONLY = ("flask", "werkzeug", "marshmallow", "apispec", "prometheus_client", "jinja2", "click", "torch")
# The web's and ops' ledger path, and psutil (host/processes.py reads /proc for what the supervisor asks).
NEVER = set(WEB_ONLY) | {"sqlalchemy", "alembic", "typing_extensions", "psutil"}


def test_the_supervisor_entry_modules_import_no_web_framework_and_no_sqlalchemy():
    # Everything a run loads: main.py imports the ledger and the runner lazily, once it holds the job lock.
    code = ("import json, sys, lora_worker.run.__main__, lora_worker.run.main, "
            "lora_worker.run.runner, lora_worker.run.seam, lora_worker.ledger.supervisor; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert "lora_worker" in loaded
    assert not NEVER & set(loaded), NEVER & set(loaded)


def test_what_only_the_end_uses_is_not_loaded_before_the_trainer_starts():
    # runner.load_the_end imports them once the trainer runs; the start pays for none of them.
    from lora_worker.run.runner import END_MODULES

    code = ("import json, sys, lora_worker.run.__main__, lora_worker.run.main, "
            "lora_worker.run.runner, lora_worker.run.seam, lora_worker.ledger.supervisor; "
            "print(json.dumps(sorted(sys.modules)))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                           text=True).stdout))
    assert not (set(END_MODULES) | {"importlib.metadata", "_hashlib"}) & loaded  # _hashlib: OpenSSL
    code = code.replace("; print", "; lora_worker.run.runner.load_the_end(); print")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                           text=True).stdout))
    assert set(END_MODULES) <= loaded
    assert "importlib.metadata" not in loaded  # dispatch's fingerprint needs it, the supervisor never does


def test_the_web_s_ledger_path_is_what_the_check_would_see():
    # The check above can fail: the repository, which the web uses, does load SQLAlchemy.
    code = ("import json, sys, lora_worker.ledger.repository; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert "sqlalchemy" in loaded


def test_the_supervisor_takes_its_job_lock_before_loading_the_ledger():
    # POST /train waits until the supervisor holds the job lock; what main.py imports up front is that wait.
    code = ("import json, sys, lora_worker.run.__main__, lora_worker.run.main; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert "lora_worker" in loaded
    assert not {"sqlalchemy", "psutil"} & set(loaded)


# Run as the supervisor's entry point: every process it becomes (both sides of its detaching fork) writes
# the top-level modules it had loaded when it exits: at exit, or as the supervisor leaves (os._exit, main.leave).
DUMP_AT_EXIT = """
import atexit, json, os, sys
def dump(how="teardown"):
    path = os.path.join(os.environ["MODULES_DUMP"], f"{os.getpid()}.json")
    with open(path + ".part", "w") as fh:  # renamed whole: the test never reads half a dump
        json.dump({"how": how, "modules": sorted({m.split(".")[0] for m in sys.modules})}, fh)
    os.replace(path + ".part", path)
atexit.register(dump)
_exit = os._exit
def dump_and_exit(rc):
    dump("_exit")
    _exit(rc)
os._exit = dump_and_exit
import pytest

from lora_worker.run.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_real_supervisor_runs_a_job_without_web_framework_or_sqlalchemy_and_leaves_without_teardown(
        migrated, host, tmp_path):
    from lora_worker import create_app
    from lora_worker.config import Settings, settings_to_json
    from lora_worker.ledger import repository as repo
    from lora_worker.ledger.db import Database
    from lora_worker.run.local import SETTINGS_ENV
    from tests.helpers import set_modes, wait_for

    dumps = tmp_path / "modules"
    dumps.mkdir()

    stderr = tmp_path / "supervisor.err"

    def launch(job_id: int, settings: Settings) -> None:
        env = {**os.environ, SETTINGS_ENV: settings_to_json(settings), "MODULES_DUMP": str(dumps)}
        with stderr.open("wb") as err:
            first = subprocess.run([sys.executable, "-c", DUMP_AT_EXIT, str(job_id)], env=env, timeout=30,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                   start_new_session=True)
        assert first.returncode == 0

    set_modes(host.sd_scripts)
    app = create_app(migrated, launch=launch)
    db = Database.open(migrated.database_path)
    try:
        job_id = app.test_client().post("/train", json=host.payload()).get_json()["worker_job_id"]
        done = wait_for(lambda: (j := repo.get_job(db, job_id)).status not in ("queued", "running") and j,
                        timeout=30, what="the end of the run")
        assert done.status == "succeeded", done.error
        dump = dumps / f"{done.supervisor_pid}.json"
        left = wait_for(lambda: dump.exists() and json.loads(dump.read_text()), what="the supervisor's exit")
    finally:
        db.dispose()
        app.extensions["lora_worker"].db.dispose()
    loaded = set(left["modules"])
    assert {"lora_worker", "sqlite3"} <= loaded  # the dump of a process that ran the job
    assert not NEVER & loaded, NEVER & loaded
    # It left by os._exit (no teardown of its imports), and its last log line was flushed before it did.
    assert left["how"] == "_exit"
    assert f"job {job_id}: succeeded" in stderr.read_text().splitlines()[-1]


# The child of the detaching fork, as the web starts it (-S, the lock named in the environment), stopped the
# moment it holds the job lock: what it loaded by then is what POST /train waited for.
AT_THE_LOCK = """
import json, os, sys
import lora_worker.host.flock as flock
real = flock.take_lock
def take(path, wait_s):
    fd = real(path, wait_s)
    with open(os.environ["MODULES_DUMP"] + ".part", "w") as fh:
        json.dump({"held": fd is not None, "modules": sorted(sys.modules)}, fh)
    os.replace(os.environ["MODULES_DUMP"] + ".part", os.environ["MODULES_DUMP"])
    os._exit(0)
flock.take_lock = take
from lora_worker.run.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_started_by_the_web_the_supervisor_holds_its_job_lock_before_loading_settings_or_logging(tmp_path):
    from lora_worker.host.detach import JOB_LOCK_ENV
    from lora_worker.run.local import supervisor_path
    from tests.helpers import wait_for

    dump = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": supervisor_path(), JOB_LOCK_ENV: str(tmp_path / "locks" / "job-7.lock"),
           "MODULES_DUMP": str(dump)}
    ready_r, ready_w = os.pipe()
    try:
        subprocess.run([sys.executable, "-S", "-c", AT_THE_LOCK, "7", f"--ready-fd={ready_w}"], env=env,
                       pass_fds=(ready_w,), check=True, timeout=30)
        wait_for(dump.exists, what="the supervisor at its lock")
    finally:
        os.close(ready_r)
        os.close(ready_w)
    at_lock = json.loads(dump.read_text())
    assert at_lock["held"]
    ours = {m for m in at_lock["modules"] if m.startswith("lora_worker")}
    assert ours == {"lora_worker", "lora_worker.run", "lora_worker.run.__main__", "lora_worker.host.detach",
                    "lora_worker.host", "lora_worker.host.flock"}
    assert not {"lora_worker.config", "logging", "typing", "pathlib", "dataclasses", "sqlite3", "site"} & set(
        at_lock["modules"])

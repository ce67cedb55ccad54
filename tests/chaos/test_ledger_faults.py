"""A locked, full or corrupt ledger: clean 503s, training that goes on, nothing lost, no silent repair."""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker import create_app
from lora_worker.config import DEFAULT_STALL_LIMITS_S, REPO_ROOT, Settings, settings_to_json
from lora_worker.errors import LedgerCorrupt
from lora_worker.ledger.migrate import verify_integrity
from lora_worker.transcript.logreader import LogReader
from lora_worker.run.local import SETTINGS_ENV
from tests.helpers import hold_exclusive, pid_alive, set_modes, wait_for
from tests.helpers.service import Service

pytestmark = pytest.mark.slow


def test_a_locked_ledger_gives_503_with_retry_after_and_training_goes_on(host, migrated):
    set_modes(host.sd_scripts, step_s=0.03, record=str(host.root / "record.json"))
    svc = Service(migrated, host.root / "gunicorn.log").start()
    try:
        job_id = svc.request("POST", "/train", host.payload())[1]["worker_job_id"]
        wait_for(lambda: svc.request("GET", f"/train/{job_id}")[1]["step"] > 5, what="training")
        reader = LogReader(migrated.log_dir, job_id)
        holder = hold_exclusive(migrated.database_path, 12.0)
        locked_at = time.monotonic()
        log_at_lock = reader.size()
        step_at_lock = svc.request("GET", f"/train/{job_id}")[1]["step"]
        started = time.monotonic()
        code, body, headers = svc.request("POST", f"/train/{job_id}/cancel", timeout=20)
        took = time.monotonic() - started
        assert (code, body["error"], headers.get("Retry-After")) == (503, "ledger_busy", "1"), body
        assert took < migrated.busy_timeout_s + 1
        # The supervisor keeps reading the trainer while the ledger waits. One epoch covers the run, so between
        # two step saves the trainer prints only redraws, which the log takes at a line's end: the lines of the
        # step save at 100 and its sample pass (≈3 s into the lock at 0.03 s a step) must reach the log in it.
        time.sleep(max(0.0, 10 - (time.monotonic() - locked_at)))
        assert holder.is_alive() and reader.size() > log_at_lock
        holder.join()
        done = wait_for(lambda: (j := svc.request("GET", f"/train/{job_id}")[1])["status"] != "running" and j,
                        timeout=60, what="the end of the run")
        assert done["status"] == "succeeded" and done["step"] == 400 > step_at_lock  # the cancel never landed
    finally:
        svc.stop()


def faulty_launcher(flag: Path, once: str = ""):
    def launch(job_id: int, settings: Settings) -> None:
        env = {**os.environ, SETTINGS_ENV: settings_to_json(settings), "FAULT_FLAG": str(flag), "FAULT_ONCE": once}
        proc = subprocess.Popen([sys.executable, "-m", "tests.chaos.faulty_supervisor", str(job_id)], cwd=REPO_ROOT,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        assert proc.wait(30) == 0
    return launch


def test_a_full_disk_on_progress_writes_never_stops_the_trainer_and_the_outcome_lands_later(host, migrated):
    flag = host.root / "disk-full"
    record = host.root / "record.json"
    set_modes(host.sd_scripts, step_s=0.01, record=str(record))
    app = create_app(migrated, launch=faulty_launcher(flag))
    client = app.test_client()
    try:
        job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
        before = wait_for(lambda: (j := client.get(f"/train/{job_id}").get_json())["step"] > 0 and j, what="steps")
        flag.touch()  # from now on every write of the supervisor fails with "database or disk is full"
        trainer = json.loads(record.read_text())["pid"]
        wait_for(lambda: not pid_alive(trainer), timeout=30, what="the trainer to finish on its own")
        # the supervisor read it all while its ledger writes failed: the run log has the end of the run
        wait_for(lambda: "model saved." in LogReader(migrated.log_dir, job_id).tail_lines(10).text, timeout=5,
                 what="the end of the run in the log")
        stuck = client.get(f"/train/{job_id}").get_json()
        assert stuck["status"] == "running" and stuck["step"] < 400  # nothing written, nothing lost either
        time.sleep(1)
        assert client.get(f"/train/{job_id}").get_json()["status"] == "running"  # the supervisor is alive
        flag.unlink()
        done = wait_for(lambda: (j := client.get(f"/train/{job_id}").get_json())["status"] != "running" and j,
                        timeout=30, what="the final state")
        assert (done["status"], done["step"], done["failure_class"]) == ("succeeded", 400, None)
        assert before["step"] < done["step"]
        # the loss points of the steps run while the disk was full were kept and written before the end
        curve = client.get(f"/train/{job_id}/progress?points=1000").get_json()["points"]
        assert curve[-1]["step"] == 400 and sum(p["step"] > before["step"] for p in curve) > 5
    finally:
        app.extensions["lora_worker"].db.dispose()


def test_a_long_wait_to_record_the_start_is_not_taken_for_a_stalled_launch(host, migrated):
    # The supervisor retries "running" while the disk is full; the watchdog must count from the trainer's
    # start, or the first look at a 1 s launching limit would call the fresh trainer stalled.
    flag = host.root / "disk-full"
    flag.touch()
    set_modes(host.sd_scripts, step_s=0.002)
    limits = {**DEFAULT_STALL_LIMITS_S, "launching": 1.0}
    app = create_app(replace(migrated, stall_limits_s=limits), launch=faulty_launcher(flag))
    client = app.test_client()
    try:
        job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
        time.sleep(2.5)
        assert client.get(f"/train/{job_id}").get_json()["status"] == "queued"  # nothing could be written yet
        flag.unlink()
        done = wait_for(lambda: (j := client.get(f"/train/{job_id}").get_json())["status"] in
                        ("succeeded", "failed", "cancelled") and j, timeout=30, what="the final state")
        assert (done["status"], done["failure_class"]) == ("succeeded", None), done
    finally:
        app.extensions["lora_worker"].db.dispose()


def test_the_trainer_pid_lands_in_the_ledger_even_when_its_first_write_meets_a_lock(host, migrated):
    # Reconcile kills a dead supervisor's trainer by the pid in the row: a write lost to a busy ledger must
    # be written again, or that trainer would run on unsupervised.
    record = host.root / "record.json"
    release = host.root / "release"
    set_modes(host.sd_scripts, step_s=0.01, record=str(record), hold_at_step=5, release_file=str(release))
    app = create_app(migrated, launch=faulty_launcher(host.root / "no-flag", once="trainer_pid"))
    client = app.test_client()
    try:
        job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
        trainer = wait_for(lambda: record.exists() and json.loads(record.read_text()), what="trainer record")
        row = wait_for(lambda: (r := sqlite3.connect(migrated.database_path).execute(
            "SELECT trainer_pid, trainer_start_ticks FROM jobs WHERE id = ?", (job_id,)).fetchone())[0] and r,
            timeout=10, what="the trainer's pid in the row")
        assert row[0] == trainer["pgid"] and row[1] is not None  # the launcher leads the job's group
        release.touch()
        done = wait_for(lambda: (j := client.get(f"/train/{job_id}").get_json())["status"] != "running" and j,
                        timeout=30, what="the final state")
        assert done["status"] == "succeeded", done
    finally:
        release.touch()
        app.extensions["lora_worker"].db.dispose()


def test_a_corrupt_ledger_stops_start_up_loudly_and_is_left_untouched(host, migrated, capsys, monkeypatch):
    path = migrated.database_path
    with path.open("r+b") as fh:
        fh.write(b"this is not an sqlite file" * 4)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(LedgerCorrupt, match="not a readable SQLite database"):
        create_app(migrated)
    from lora_worker.ops import cli
    monkeypatch.setattr(cli, "load_settings", lambda: migrated)
    for command in ("reconcile", "migrate"):
        assert cli.main([command]) == 1
        assert "ledger" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="gunicorn exited"):
        Service(migrated, host.root / "gunicorn.log").start()
    assert "LedgerCorrupt" in (host.root / "gunicorn.log").read_text()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_a_damaged_page_fails_the_full_integrity_check_and_its_unit(host, migrated):
    # `lora-worker check-ledger` (the daily lora-worker-check.service) reads every page; a start reads a bounded
    # part (tests/ledger). The real command, as systemd runs it: exit 1 fails the unit, stderr is the journal's.
    conn = sqlite3.connect(migrated.database_path)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("CREATE TABLE filler (x)")
    conn.executemany("INSERT INTO filler VALUES (?)", [("x" * 500,)] * 2000)
    conn.commit()
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with migrated.database_path.open("r+b") as fh:
        fh.seek(page_size * 20)
        fh.write(os.urandom(page_size))
    digest = hashlib.sha256(migrated.database_path.read_bytes()).hexdigest()
    env = {**os.environ, "LORA_WORKER_STATE_DIR": str(migrated.state_dir), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("LORA_WORKER_CONFIG", None)
    result = subprocess.run([sys.executable, "-m", "lora_worker.ops.cli", "check-ledger"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"lora-worker check-ledger: ledger {migrated.database_path} " in result.stderr
    assert "restore" in result.stderr and result.stdout == ""
    assert hashlib.sha256(migrated.database_path.read_bytes()).hexdigest() == digest  # never repaired
    with pytest.raises(LedgerCorrupt):
        verify_integrity(migrated.database_path)

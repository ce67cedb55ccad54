"""A model of the job lifecycle driven by Hypothesis: submit, cancel, kill the supervisor, restart the web app,
let the trainer finish — in any order — with the invariants checked after every step. Real processes run:
the detached supervisor, the fake launcher and the fake trainer (held at step 5 until released).

CHAOS_MODEL_EXAMPLES (default 6) sets how many sequences run; `make chaos` runs more.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lora_worker import create_app
from tests.chaos.invariants import TERMINAL, active_rows, integrity_ok, terminal_events
from tests.helpers import make_host, pid_alive, set_modes, wait_for
from tests.helpers.ledger import migrated_ledger

EXAMPLES = int(os.environ.get("CHAOS_MODEL_EXAMPLES", "6"))


class JobLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="lifecycle-"))
        self.host = make_host(self.root, cancel_grace_s=0.5)
        self.settings = self.host.settings
        migrated_ledger(self.settings.database_path)
        self.app = create_app(self.settings)
        self.client = self.app.test_client()
        self.jobs: dict[int, dict] = {}  # job id -> {"record": path, "release": path, "final": status or None}
        self.n = 0

    # -- rules ---------------------------------------------------------------------------------------------

    @initialize()
    def start(self) -> None:
        assert active_rows(self.settings.database_path) == 0

    @rule()
    def submit(self) -> None:
        self.n += 1
        record, release = self.root / f"record-{self.n}.json", self.root / f"release-{self.n}"
        set_modes(self.settings.sd_scripts_dir, step_s=0.002, hold_at_step=5, release_file=str(release),
                  record=str(record))
        response = self.client.post("/train", json=self.host.payload(output_name=f"m{self.n}"))
        if response.status_code == 202:
            job_id = response.get_json()["worker_job_id"]
            self.jobs[job_id] = {"record": record, "release": release, "final": None}
            wait_for(lambda: record.exists() or self._status(job_id) in TERMINAL, what="the trainer to start")
        else:
            assert response.status_code == 409 and response.get_json()["error"] == "job_active"
            assert self._active() is not None

    @rule()
    def cancel(self) -> None:
        job_id = self._active() or max(self.jobs, default=None)
        if job_id is None:
            return
        response = self.client.post(f"/train/{job_id}/cancel")
        assert response.status_code in (202, 409), response.get_json()
        if response.status_code == 202:
            wait_for(lambda: self._status(job_id) in TERMINAL, timeout=15, what="the cancel to land")

    @rule()
    def kill_supervisor(self) -> None:
        job_id = self._active()
        if job_id is None:
            return
        pid = wait_for(lambda: self.client.get(f"/train/{job_id}").get_json().get("status") in TERMINAL
                       or self._row(job_id, "supervisor_pid"), what="the supervisor")
        if isinstance(pid, int) and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not pid_alive(pid), what="the supervisor to die")

    @rule()
    def restart_web(self) -> None:
        self.app.extensions["lora_worker"].db.dispose()
        self.app = create_app(self.settings)  # the start-up reconcile runs here
        self.client = self.app.test_client()

    @rule()
    def trainer_finishes(self) -> None:
        job_id = self._active()
        if job_id is None:
            return
        self.jobs[job_id]["release"].touch()
        wait_for(lambda: self._status(job_id) in TERMINAL, timeout=20, what="the run to finish")

    # -- invariants ----------------------------------------------------------------------------------------

    @invariant()
    def at_most_one_active_job(self) -> None:
        assert active_rows(self.settings.database_path) <= 1

    @invariant()
    def a_terminal_job_never_changes_and_leaves_nothing_running(self) -> None:
        for job_id, seen in self.jobs.items():
            status = self._status(job_id)
            if seen["final"] is not None:
                assert status == seen["final"], f"job {job_id} left {seen['final']} for {status}"
            elif status in TERMINAL:
                seen["final"] = status
                assert terminal_events(self.settings.database_path, job_id) == [status]
                if seen["record"].exists():
                    rec = json.loads(seen["record"].read_text())
                    wait_for(lambda: not pid_alive(rec["pid"]) and not pid_alive(rec["pgid"]), timeout=5,
                             what=f"job {job_id}'s processes gone")

    @invariant()
    def the_ledger_is_intact(self) -> None:
        assert integrity_ok(self.settings.database_path)

    def teardown(self) -> None:
        job_id = self._active()
        if job_id is not None:
            self.client.post(f"/train/{job_id}/cancel")
            wait_for(lambda: self._status(job_id) in TERMINAL, timeout=15, what="the last job to end")
        self.app.extensions["lora_worker"].db.dispose()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------------------------

    def _status(self, job_id: int) -> str:
        return self.client.get(f"/train/{job_id}").get_json()["status"]

    def _active(self) -> int | None:
        jobs = self.client.get("/train?status=queued&status=running").get_json()["jobs"]
        return jobs[0]["worker_job_id"] if jobs else None

    def _row(self, job_id: int, column: str) -> object:
        conn = sqlite3.connect(self.settings.database_path)
        try:
            return conn.execute(f"SELECT {column} FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
        finally:
            conn.close()


JobLifecycle.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=8, deadline=None,
                                          suppress_health_check=list(HealthCheck))
test_job_lifecycle = pytest.mark.slow(pytest.mark.timeout(900)(JobLifecycle.TestCase))

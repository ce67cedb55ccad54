"""Kill something at a random moment of a run, again and again: the web process, the supervisor, the launcher
or the trainer. Afterwards the job has exactly one honest terminal state, nothing of it is left running,
what clients saw never went backwards, and the ledger is intact.

CHAOS_ITERATIONS (default 12: with the default seed, every target is killed mid-run at least once) and
CHAOS_SEED set the loop; `make chaos` runs a long one (200). The run loop's rules themselves are unit-tested
without processes (tests/run/test_loop_rules.py), so `make test` needs only this smoke of the real thing.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import sqlite3
import threading
import time

import pytest

from tests.chaos.invariants import TERMINAL, Timeline, autopsy, integrity_ok, terminal_events
from tests.helpers import pid_alive, set_modes, wait_for
from tests.helpers.service import Service

ITERATIONS = int(os.environ.get("CHAOS_ITERATIONS", "12"))
SEED = int(os.environ.get("CHAOS_SEED", "20261130"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(900, ITERATIONS * 15))]
TARGETS = ("web", "supervisor", "launcher", "trainer")
# What each kill may honestly end in: the kill may also land after the run's own end.
OUTCOMES = {
    "web": {("succeeded", None)},
    "supervisor": {("failed", "supervisor_lost"), ("succeeded", None)},
    "launcher": {("failed", "killed_by_signal"), ("succeeded", None)},
    "trainer": {("failed", "killed_by_signal"), ("succeeded", None)},
}


class Watcher:
    """Polls the job over HTTP in the background, through web restarts, recording what it sees."""

    def __init__(self, holder: dict, job_id: int) -> None:
        self.holder, self.job_id = holder, job_id
        self.timeline = Timeline()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                code, body, _ = self.holder["svc"].request("GET", f"/train/{self.job_id}", timeout=5)
                if code == 200:
                    self.timeline.add(body)
            except (OSError, http.client.HTTPException):
                pass  # the web process is down right now, or was killed halfway through its answer
            time.sleep(0.05)

    def close(self) -> Timeline:
        self.stop.set()
        self.thread.join(10)
        return self.timeline


def supervisor_pid(db, job_id: int) -> int | None:
    conn = sqlite3.connect(db, timeout=30)
    try:
        row = conn.execute("SELECT supervisor_pid FROM jobs WHERE id = ?", (job_id,)).fetchone()
    finally:
        conn.close()
    return row[0] if row else None


def test_random_kills_never_break_the_invariants(host, migrated):
    rng = random.Random(SEED)
    record = host.root / "record.json"
    holder = {"svc": Service(migrated, host.root / "gunicorn.log").start()}
    seen: dict[str, int] = {t: 0 for t in TARGETS}
    landed: dict[str, int] = {t: 0 for t in TARGETS}  # kills that hit a live process, not one already gone
    try:
        for i in range(ITERATIONS):
            target = rng.choice(TARGETS)
            delay = rng.uniform(0.0, 2.0)
            seen[target] += 1
            record.unlink(missing_ok=True)
            # 400 steps of 8 ms: the run outlasts the longest delay, so a kill of its processes lands mid-run
            set_modes(host.sd_scripts, step_s=0.008, record=str(record), grandchild=rng.choice([None, "group"]))
            code, body, _ = holder["svc"].request("POST", "/train", host.payload(output_name=f"chaos{i}"))
            assert code == 202, body
            job_id = body["worker_job_id"]
            watcher = Watcher(holder, job_id)
            time.sleep(delay)
            if target == "web":
                holder["svc"].kill_9()
                landed[target] += 1
                time.sleep(rng.uniform(0, 1))
                holder["svc"] = Service(migrated, host.root / f"gunicorn-{i}.log").start()
            else:
                if target == "supervisor":
                    pid = wait_for(lambda: supervisor_pid(migrated.database_path, job_id), what="supervisor pid")
                else:
                    rec = wait_for(lambda: record.exists() and json.loads(record.read_text()), what="record")
                    pid = rec["pgid"] if target == "launcher" else rec["pid"]
                alive = pid_alive(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                    landed[target] += alive
                except ProcessLookupError:
                    pass  # it already ended on its own
            where = f"seed {SEED}, iteration {i}: {target} killed after {delay:.3f} s, job {job_id}"
            done = wait_for(lambda: (j := holder["svc"].request("GET", f"/train/{job_id}")[1])["status"]
                            in TERMINAL and j, timeout=40, what=f"job {job_id} to end ({where})")
            time.sleep(0.3)
            timeline = watcher.close()
            assert (done["status"], done["failure_class"]) in OUTCOMES[target], (where, done)
            assert timeline.problems() == [], where
            assert terminal_events(migrated.database_path, job_id) == [done["status"]], where
            rec = json.loads(record.read_text()) if record.exists() else {}
            job_pids = [p for p in (rec.get("pid"), rec.get("pgid"), rec.get("grandchild")) if p]
            try:
                wait_for(lambda: not any(pid_alive(p) for p in job_pids), timeout=5, what="no process of the job")
            except AssertionError as exc:
                raise AssertionError(f"{exc} ({where}); the record: pid {rec.get('pid')}, pgid {rec.get('pgid')}, "
                                     f"grandchild {rec.get('grandchild')}\n"
                                     + autopsy(migrated.database_path, job_id, job_pids)) from None
            sup = supervisor_pid(migrated.database_path, job_id)
            wait_for(lambda: not sup or not pid_alive(sup), timeout=10, what=f"the supervisor to exit ({where})")
            assert integrity_ok(migrated.database_path), where
    finally:
        holder["svc"].stop()
    print(f"chaos: {ITERATIONS} iterations, seed {SEED}, kills per target: {seen}, of which landed: {landed}")
    assert all(landed[t] for t in TARGETS if seen[t]), f"no kill landed on some target: {landed}"

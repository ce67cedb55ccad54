"""Kill something at a random moment of a run, again and again: the web process, the supervisor, the launcher
or the trainer. Afterwards the job has exactly one honest terminal state, nothing of it is left running,
what clients saw never went backwards, and the ledger is intact.

CHAOS_ITERATIONS (default ITERATIONS below; `make chaos` runs 200) and CHAOS_SEED set the loop (seeds.py: a new
seed each run unless set, named by every failure). Every 4 iterations kill each target once, in a drawn order.
The run loop's rules themselves are unit-tested without processes (tests/run/test_loop_rules.py); what a
random kill found once is a deterministic test here too.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from lora_worker import create_app
from lora_worker.config import REPO_ROOT, Settings, settings_to_json
from lora_worker.host.locks import is_locked, job_lock_path
from lora_worker.run.local import SETTINGS_ENV
from tests.chaos import seeds
from tests.chaos.invariants import TERMINAL, Timeline, autopsy, integrity_ok, processes_with_arg, terminal_events
from tests.helpers import pid_alive, set_modes, wait_for
from tests.helpers.service import Service

ITERATIONS = seeds.iterations(100)  # docs/testing.md, "Which runs where"
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
    return column(db, job_id, "supervisor_pid")


def column(db, job_id: int, name: str):  # type: ignore[no-untyped-def]
    conn = sqlite3.connect(db, timeout=30)
    try:
        row = conn.execute(f"SELECT {name} FROM jobs WHERE id = ?", (job_id,)).fetchone()
    finally:
        conn.close()
    return row[0] if row else None


def launch_killed_after_spawn(record):  # type: ignore[no-untyped-def]
    """The app's launch: a supervisor that dies between starting the trainer and writing its pid
    (tests/chaos/killed_after_spawn.py)."""
    def launch(job_id: int, settings: Settings) -> None:
        env = {**os.environ, SETTINGS_ENV: settings_to_json(settings), "RECORD": str(record)}
        proc = subprocess.Popen([sys.executable, "-m", "tests.chaos.killed_after_spawn", str(job_id)], cwd=REPO_ROOT,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        assert proc.wait(30) == 0  # the detached supervisor holds the job lock
    return launch


@pytest.mark.parametrize("grandchild", [None, "group", "session"])
def test_a_supervisor_killed_before_it_recorded_its_trainer_leaves_no_process_of_the_job(host, migrated,
                                                                                          grandchild):
    # The window the random kills found: the trainer runs, the row has no trainer_pid yet. The trainer stays
    # silent after its record (as the real one is while it loads the model), so it does not die at its next
    # write into the dead supervisor's pipe: the whole tree is there for reconcile to find.
    record = host.root / "record.json"
    set_modes(host.sd_scripts, record=str(record), grandchild=grandchild, hang_in="launching")
    app = create_app(migrated, launch=launch_killed_after_spawn(record))
    client, job_pids = app.test_client(), []
    try:
        job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
        wait_for(lambda: not is_locked(job_lock_path(migrated, job_id)), what="the supervisor to die")
        rec = json.loads(record.read_text())
        job_pids = [p for p in (rec["pid"], rec["pgid"], rec["grandchild"]) if p]
        assert all(pid_alive(p) for p in job_pids)  # the trainer runs on, its supervisor gone
        assert column(migrated.database_path, job_id, "trainer_pid") is None  # and the row does not name it
        done = client.get(f"/train/{job_id}").get_json()  # reconcile
        alive = [p for p in job_pids if pid_alive(p)]  # at once: a terminal row means no process of the job
        assert (done["status"], done["failure_class"]) == ("failed", "supervisor_lost")
        assert alive == [], autopsy(migrated.database_path, job_id, alive)
        assert all(str(p) in done["error"] for p in job_pids) and "killed its leftover processes" in done["error"]
    finally:
        for pid in job_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        app.extensions["lora_worker"].db.dispose()


def test_random_kills_never_break_the_invariants(host, migrated):
    seed = seeds.draw()
    print(f"chaos: seed {seed}, {ITERATIONS} iterations")
    rng = random.Random(seed)
    record = host.root / "record.json"
    holder = {"svc": Service(migrated, host.root / "gunicorn.log").start()}
    seen: dict[str, int] = {t: 0 for t in TARGETS}
    landed: dict[str, int] = {t: 0 for t in TARGETS}  # kills that hit a live process, not one already gone
    try:
        order: list[str] = []
        for i in range(ITERATIONS):
            order = order or rng.sample(TARGETS, len(TARGETS))
            target = order.pop()
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
            where = f"iteration {i}: {target} killed after {delay:.3f} s, job {job_id}; {seeds.replay(seed, i)}"
            done = wait_for(lambda: (j := holder["svc"].request("GET", f"/train/{job_id}")[1])["status"]
                            in TERMINAL and j, timeout=40, what=f"job {job_id} to end ({where})")
            time.sleep(0.3)
            timeline = watcher.close()
            assert (done["status"], done["failure_class"]) in OUTCOMES[target], (where, done)
            assert timeline.problems() == [], where
            assert terminal_events(migrated.database_path, job_id) == [done["status"]], where
            # No process of an ended job: those its record names, and any with its LoRA's name in its argv (a
            # trainer may not have written its record yet when its supervisor was killed).
            rec = json.loads(record.read_text()) if record.exists() else {}
            job_pids = [p for p in (rec.get("pid"), rec.get("pgid"), rec.get("grandchild")) if p]
            alive = [p for p in dict.fromkeys(job_pids + processes_with_arg(f"--output_name=chaos{i}"))
                     if pid_alive(p)]
            assert not alive, (f"processes {alive} of the ended job are alive ({where}); the record: pid "
                               f"{rec.get('pid')}, pgid {rec.get('pgid')}, grandchild {rec.get('grandchild')}\n"
                               + autopsy(migrated.database_path, job_id, alive))
            sup = supervisor_pid(migrated.database_path, job_id)
            wait_for(lambda: not sup or not pid_alive(sup), timeout=10, what=f"the supervisor to exit ({where})")
            assert integrity_ok(migrated.database_path), where
    finally:
        holder["svc"].stop()
    print(f"chaos: {ITERATIONS} iterations, seed {seed}, kills per target: {seen}, of which landed: {landed}")
    assert all(landed[t] for t in TARGETS if seen[t]), f"no kill landed on some target: {landed} (seed {seed})"

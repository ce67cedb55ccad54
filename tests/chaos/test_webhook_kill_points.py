"""At least once, whatever is killed when: the sender SIGKILLed at each point of a delivery, then at random
moments again and again. Afterwards every event of the job has reached the receiver (under its own id, so a
receiver that drops repeats keeps each once, in order), the outbox says delivered, and the ledger is intact.
Every start after a kill succeeds; a sender that cannot start says why within its own bound, and the next
one starts.

Each random iteration starts a real process: ~0.7 s on a quiet 2-core machine, ~1.2 s at a load of 8 (measured
2026-12-06, 200 iterations: 137 s and 247 s). `make chaos` runs 200, past pytest-timeout's 120 s default,
which is what failed issue #37's run (the sender was starting normally when the timeout fired), so the test's
budget grows with CHAOS_ITERATIONS (`time_budget_s`)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from lora_worker.config import settings_to_json
from lora_worker.errors import LaunchFailed
from lora_worker.host.locks import lock_state, take_lock
from lora_worker.host.starter import LAUNCH_TIMEOUT_S, start_detached
from lora_worker.ledger import outbox
from lora_worker.run.local import SETTINGS_ENV
from lora_worker.webhooks.process import ensure_sender, sender_lock_path, sender_running, stop_sender
from tests.chaos import seeds
from tests.chaos.invariants import integrity_ok
from tests.helpers import pid_alive, wait_for
from tests.webhooks.jobs import a_finished_job, states
from tests.webhooks.receiver import Answer, delivered_once_each

ITERATIONS = seeds.iterations(100)  # CHAOS_SEED, CHAOS_ITERATIONS: tests/chaos/seeds.py, docs/testing.md
PER_ITERATION_S = 5.0  # four times the worst measured (1.2 s, above)
MAKE_CHAOS_ITERATIONS = 200


def time_budget_s(iterations: int) -> float:
    return 120 + iterations * PER_ITERATION_S


pytestmark = [pytest.mark.slow, pytest.mark.timeout(time_budget_s(ITERATIONS))]


def written_ids(db, job_id: int) -> list[str]:
    with db.reading() as d:
        return [event_id for event_id, _ in outbox.bodies(d, job_id)]


@pytest.mark.parametrize("point, seen_first", [("before_post", 1), ("after_post", 2), ("in_settle", 2)])
def test_a_sender_killed_at_any_point_of_a_delivery_loses_no_event(hooked, hooked_db, receiver, secret, point,
                                                                   seen_first):
    job_id = a_finished_job(hooked_db)
    ids = written_ids(hooked_db, job_id)
    env = {**os.environ, SETTINGS_ENV: settings_to_json(hooked), "KILL_AT": point}
    faulty = subprocess.run([sys.executable, "-m", "tests.chaos.faulty_sender"], env=env, timeout=60)
    assert faulty.returncode == -signal.SIGKILL
    ensure_sender(hooked)  # the next sender: the web's start, or systemd's restart
    wait_for(lambda: states(hooked_db, job_id) == ["delivered"] * 3, timeout=30, what="every event delivered")
    got = receiver.deliveries
    assert [d.event_id for d in got].count(ids[0]) == seen_first
    assert [d.event_id for d in delivered_once_each(got)] == ids  # each once for a deduplicating receiver
    assert all(d.verified(secret) for d in got)
    with hooked_db.reading() as d:
        first = outbox.deliveries(d, job_id)[0]
    if point != "in_settle":  # killed before the answer was written: the next sender closed it as interrupted
        assert first["attempts"][0]["error"].startswith("interrupted")
    assert integrity_ok(hooked.database_path)


def test_random_kills_of_the_sender_never_lose_an_event(hooked, hooked_db, receiver, secret):
    seed = seeds.draw()
    print(f"chaos: seed {seed}, {ITERATIONS} iterations")
    rng = random.Random(seed)
    receiver.script = [Answer(503) if rng.random() < 0.3 else Answer(200) for _ in range(200)]
    jobs = [a_finished_job(hooked_db) for _ in range(4)]
    expected = {job_id: written_ids(hooked_db, job_id) for job_id in jobs}
    for iteration in range(ITERATIONS):
        ensure_sender(hooked)
        pid = lock_state(sender_lock_path(hooked)).holder_pid
        assert pid is not None, (f"iteration {iteration}: no sender started after the last one was killed "
                                 f"({seeds.replay(seed, iteration)})")
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pid, signal.SIGKILL)
        # Its lock, not its pid: the killed process shows as a zombie while its other threads still exit, and
        # the lock is free only once the last of them has closed its files (a start in between would find it
        # held and start nothing).
        wait_for(lambda pid=pid: not pid_alive(pid) and not sender_running(hooked), what="the killed sender gone")
    ensure_sender(hooked)
    for job_id in jobs:
        wait_for(lambda job_id=job_id: states(hooked_db, job_id) == ["delivered"] * 3, timeout=60,
                 what=f"job {job_id}'s events delivered ({seeds.replay(seed, ITERATIONS - 1)})")
    stop_sender(hooked)
    kept = delivered_once_each(receiver.deliveries)
    for job_id, ids in expected.items():  # per job, each event once, in the order it was written
        assert [d.event_id for d in kept if d.verified(secret)["data"]["worker_job_id"] == job_id] == ids
    assert integrity_ok(hooked.database_path)


def test_the_random_kills_have_time_for_every_iteration_of_make_chaos():
    # Issue #37: 200 iterations of a process start under pytest-timeout's 120 s default (175 fitted, measured).
    (mark,) = [m for m in pytestmark if m.name == "timeout"]
    assert mark.args[0] == time_budget_s(ITERATIONS)  # not the 120 s default
    assert time_budget_s(MAKE_CHAOS_ITERATIONS) - time_budget_s(0) >= MAKE_CHAOS_ITERATIONS * 1.2 * 4


@pytest.mark.parametrize("obstacle", ["another process holds the sender's lock", "the secret is readable by all"])
def test_a_sender_that_cannot_start_says_why_within_its_bound_and_the_next_one_starts(hooked, capfd, obstacle):
    # The real sender, paused after each close of its ready pipe (tests/chaos/faulty_sender.py): whatever its
    # starter sees when the pipe speaks, it sees for that long. It once closed the pipe before its lock, so the
    # next start, right after, found the lock held by a sender on its way out, and started none.
    env = {**os.environ, SETTINGS_ENV: settings_to_json(hooked)}
    holder = take_lock(sender_lock_path(hooked), 1.0) if obstacle.startswith("another") else None
    if holder is None:
        hooked.webhook_secret_file.chmod(0o644)
    started = time.monotonic()
    with pytest.raises(LaunchFailed):
        start_detached([sys.executable, "-m", "tests.chaos.faulty_sender"], env, what="The webhook sender")
    assert time.monotonic() - started < LAUNCH_TIMEOUT_S  # its own bound (the lock's 2 s wait), not the launch's
    if holder is not None:
        os.close(holder)
    else:
        hooked.webhook_secret_file.chmod(0o600)
    assert not sender_running(hooked)  # the failed one holds nothing once it has said so
    ensure_sender(hooked)  # the next attempt
    assert lock_state(sender_lock_path(hooked)).holder_pid is not None
    why = "another sender holds" if holder is not None else "readable by every user"
    assert why in capfd.readouterr().err  # its own log says why (the journal, under systemd)

"""At least once, whatever is killed when: the sender SIGKILLed at each point of a delivery, then at random
moments again and again. Afterwards every event of the job has reached the receiver (under its own id, so a
receiver that drops repeats keeps each once, in order), the outbox says delivered, and the ledger is intact."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from lora_worker.config import settings_to_json
from lora_worker.host.locks import lock_state
from lora_worker.ledger import outbox
from lora_worker.run.local import SETTINGS_ENV
from lora_worker.webhooks.process import ensure_sender, sender_lock_path, stop_sender
from tests.chaos import seeds
from tests.chaos.invariants import integrity_ok
from tests.helpers import pid_alive, wait_for
from tests.webhooks.jobs import a_finished_job, states
from tests.webhooks.receiver import Answer, delivered_once_each

ITERATIONS = seeds.iterations(100)  # CHAOS_SEED, CHAOS_ITERATIONS: tests/chaos/seeds.py, docs/testing.md
pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(120, ITERATIONS * 4))]  # ~1 s an iteration, loaded


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
    for _ in range(ITERATIONS):
        ensure_sender(hooked)
        time.sleep(rng.uniform(0.0, 0.3))
        pid = lock_state(sender_lock_path(hooked)).holder_pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda pid=pid: not pid_alive(pid), what="the killed sender gone")
    ensure_sender(hooked)
    for job_id in jobs:
        wait_for(lambda job_id=job_id: states(hooked_db, job_id) == ["delivered"] * 3, timeout=60,
                 what=f"job {job_id}'s events delivered ({seeds.replay(seed, ITERATIONS - 1)})")
    stop_sender(hooked)
    kept = delivered_once_each(receiver.deliveries)
    for job_id, ids in expected.items():  # per job, each event once, in the order it was written
        assert [d.event_id for d in kept if d.verified(secret)["data"]["worker_job_id"] == job_id] == ids
    assert integrity_ok(hooked.database_path)

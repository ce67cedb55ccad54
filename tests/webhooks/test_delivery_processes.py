"""Webhooks with real processes: the web, a job's detached supervisor running the fake trainer, the sender
(`python -m lora_worker.webhooks`) and a receiver on loopback. Every event of a job arrives, in order, verified;
a receiver down across a restart gets everything after; a sender killed in the middle of a POST sends that
event again under the same id; a job that ends while the web is down still tells arbo."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from lora_worker import create_app
from lora_worker.host.locks import lock_state
from lora_worker.ledger import outbox
from lora_worker.webhooks.process import ensure_sender, sender_lock_path, sender_running, stop_sender
from tests.helpers import pid_alive, set_modes, wait_for
from tests.webhooks.receiver import Answer, Receiver, delivered_once_each

pytestmark = pytest.mark.slow
TERMINAL_TYPES = ("job.succeeded", "job.failed", "job.cancelled")


@pytest.fixture
def web(hooked):
    apps = []

    def start(settings=hooked):
        app = create_app(settings)
        apps.append(app)
        return app.test_client()

    yield start
    for app in apps:
        app.extensions["lora_worker"].db.dispose()


def submit(client, host, **overrides) -> int:
    response = client.post("/train", json=host.payload(**overrides))
    assert response.status_code == 202, response.get_json()
    return response.get_json()["worker_job_id"]


def ended(deliveries) -> bool:
    return any(d.event["type"] in TERMINAL_TYPES for d in deliveries)


def sender_pid(settings) -> int:
    pid = wait_for(lambda: lock_state(sender_lock_path(settings)).holder_pid, what="the sender's lock")
    assert pid is not None
    return pid


def test_every_event_of_a_real_job_arrives_in_order_each_verified(web, hooked, host, receiver, secret):
    set_modes(host.sd_scripts, step_s=0.004)
    client = web()
    job_id = submit(client, host)
    got = receiver.wait_for(ended, timeout=60)
    bodies = [d.verified(secret) for d in got]  # raises unless standardwebhooks accepts each signature
    types = [b["type"] for b in bodies]
    assert types[:2] == ["job.queued", "job.started"] and types[-1] == "job.succeeded", types
    assert "job.phase" in types and "job.progress" in types
    assert [b["data"]["phase"] for b in bodies if b["type"] == "job.phase"][-1] == "saving"
    assert len({d.event_id for d in got}) == len(got)  # nothing twice on a healthy path
    with host_db(hooked) as d:  # the order they arrived in is the order they were written
        assert [d_.event_id for d_ in got] == [i for i, _ in outbox.bodies(d, job_id)]
    final = bodies[-1]["data"]
    shown = client.get(f"/train/{job_id}").get_json()
    assert (final["status"], final["lora_path"], final["lora_sha256"]) == (
        shown["status"], shown["lora_path"], shown["lora_sha256"])


def test_a_job_that_ends_while_the_web_is_down_still_sends_its_ending(web, hooked, host, receiver, secret):
    release = host.root / "release"
    set_modes(host.sd_scripts, hold_at_step=50, release_file=str(release))
    client = web()
    job_id = submit(client, host)
    receiver.wait_for(lambda ds: "job.progress" in [d.event["type"] for d in ds], timeout=30)
    client.application.extensions["lora_worker"].db.dispose()  # the web is gone: no app, no request
    del client
    release.touch()  # the supervisor ends the job with nobody serving HTTP
    got = receiver.wait_for(ended, timeout=60)
    assert got[-1].verified(secret)["type"] == "job.succeeded"
    assert got[-1].verified(secret)["data"]["worker_job_id"] == job_id


def test_a_receiver_down_across_a_restart_of_the_worker_gets_everything_after(web, hooked, host, receiver,
                                                                                secret):
    port = receiver.server.server_address[1]
    receiver.stop()  # down before the job even starts
    set_modes(host.sd_scripts, step_s=0.002)
    client = web()
    job_id = submit(client, host)
    wait_for(lambda: client.get(f"/train/{job_id}").get_json()["status"] == "succeeded", timeout=60)
    stop_sender(hooked)  # the whole worker restarts: the sender stops, then the web and a sender start again
    assert not sender_running(hooked)
    back = Receiver(port=port).start()
    try:
        web()  # start-up starts a sender for what the outbox holds
        got = back.wait_for(ended, timeout=60)
        types = [d.verified(secret)["type"] for d in delivered_once_each(got)]
        assert types[0] == "job.queued" and types[-1] == "job.succeeded"
        wait_for(lambda: states_all_delivered(hooked, job_id), what="the outbox to say delivered")
    finally:
        back.stop()


def test_a_sender_killed_in_the_middle_of_a_post_sends_that_event_again_under_its_id(web, hooked, host,
                                                                                     receiver, secret):
    hold = threading.Event()
    receiver.script = [Answer(200, hold=hold)]  # the first request is caught in flight
    set_modes(host.sd_scripts, step_s=0.002)
    client = web()
    job_id = submit(client, host)
    first = receiver.wait_for(lambda ds: len(ds) >= 1, timeout=30)[0]
    victim = sender_pid(hooked)
    os.kill(victim, signal.SIGKILL)  # mid-POST: the receiver holds the request open
    # Its lock, not its pid: the leader shows as a zombie while the thread in the POST still exits, and only the
    # last thread's exit frees the lock (the next start would find it held and start nothing: 2 runs in 3, quiet).
    wait_for(lambda: not pid_alive(victim) and not sender_running(hooked), what="the killed sender to be gone")
    hold.set()  # its 200 now goes to a dead socket: the worker never learnt it was delivered
    ensure_sender(hooked)  # what the web does at its next start or dispatch
    got = receiver.wait_for(ended, timeout=60)
    assert [d.event_id for d in got].count(first.event_id) == 2  # sent again, under the same id
    kept = delivered_once_each(got)
    assert kept[0].verified(secret)["type"] == "job.queued" and ended(kept)
    with host_db(hooked) as d:
        (queued,) = [e for e in outbox.deliveries(d, job_id) if e["event_id"] == first.event_id]
    assert queued["attempts"][0]["error"].startswith("interrupted") and queued["state"] == "delivered"


def test_a_job_that_opted_out_sends_nothing_and_one_may_choose_its_types(web, hooked, host, receiver, secret):
    set_modes(host.sd_scripts, step_s=0.002)
    client = web()
    quiet = submit(client, host, webhook_events=[])
    wait_for(lambda: client.get(f"/train/{quiet}").get_json()["status"] == "succeeded", timeout=60)
    only_end = submit(client, host, webhook_events=["job.succeeded", "job.failed"], output_name="second")
    got = receiver.wait_for(ended, timeout=60)
    assert [d.verified(secret)["data"]["worker_job_id"] for d in got] == [only_end]
    assert [d.event["type"] for d in got] == ["job.succeeded"]


def states_all_delivered(settings, job_id: int) -> bool:
    with host_db(settings) as d:
        return {e["state"] for e in outbox.deliveries(d, job_id)} == {"delivered"}


class host_db:  # noqa: N801 - a context manager read like a function
    """A read of the ledger the test's worker writes, opened and closed around one block."""

    def __init__(self, settings) -> None:
        from lora_worker.ledger.db import Database

        self.db = Database.open(settings.database_path)

    def __enter__(self):
        self._ctx = self.db.reading()
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        try:
            return self._ctx.__exit__(*exc)
        finally:
            self.db.dispose()



def test_a_sender_whose_starter_stopped_waiting_delivers_all_the_same(hooked, hooked_db, receiver, secret):
    """A start slower than its starter's bound (a cold page cache under load once took a sender over 20 s): the
    starter has closed its end of the ready pipe when the sender writes to it. The sender holds the lock, so it
    delivers rather than die on the broken pipe and leave every event waiting for the next start."""
    import subprocess
    import sys

    from lora_worker.config import settings_to_json
    from lora_worker.host.detach import READY_FD_FLAG
    from lora_worker.run.local import SETTINGS_ENV
    from tests.webhooks.jobs import a_finished_job, states

    job_id = a_finished_job(hooked_db)
    ready_r, ready_w = os.pipe()
    os.close(ready_r)  # the starter gave up before the sender said ready
    try:
        first = subprocess.run([sys.executable, "-m", "lora_worker.webhooks", f"{READY_FD_FLAG}{ready_w}"],
                               pass_fds=(ready_w,), env={**os.environ, SETTINGS_ENV: settings_to_json(hooked)},
                               stdin=subprocess.DEVNULL, timeout=60, check=False)
    finally:
        os.close(ready_w)
    assert first.returncode == 0  # the first of the two forks; the sender itself lives on, detached
    try:
        wait_for(lambda: states(hooked_db, job_id) == ["delivered"] * 3, timeout=60,
                 what="every event delivered by the sender nobody waited for")
        assert sender_running(hooked)
        assert all(d.verified(secret) for d in receiver.deliveries)
    finally:
        stop_sender(hooked)

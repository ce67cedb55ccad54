"""The outbox: each event is written by the statement that makes the change it tells of, in its transaction,
through either ledger path; no change without its event, no event without its change."""
from __future__ import annotations

import sqlite3
from dataclasses import replace
import time

import pytest

from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.states import FailureClass, JobState
from tests.helpers.ledger import columns
from tests.webhooks.jobs import deliver_all, events, subscribed


def test_a_job_without_a_subscription_leaves_no_event(hooked_db):
    job = repo.create_job(hooked_db, columns())
    repo.transition(hooked_db, job.id, JobState.RUNNING, actor="supervisor", phase="launching")
    repo.update_running(hooked_db, job.id, step=3, phase="training")
    repo.transition(hooked_db, job.id, JobState.SUCCEEDED, actor="supervisor")
    assert events(hooked_db) == []


def test_every_change_of_a_job_leaves_its_event_in_order(hooked_db):
    job = repo.create_job(hooked_db, subscribed())
    repo.transition(hooked_db, job.id, JobState.RUNNING, actor="supervisor", phase="launching")
    repo.update_running(hooked_db, job.id, phase="loading_model")
    repo.update_running(hooked_db, job.id, phase="loading_model")  # no change of phase: no event
    repo.update_running(hooked_db, job.id, phase="training", step=1, loss=0.2)
    repo.transition(hooked_db, job.id, JobState.SUCCEEDED, actor="supervisor", lora_path="/x.safetensors",
                    lora_sha256="ab" * 32)
    got = events(hooked_db)
    assert [t for t, _ in got] == ["job.queued", "job.started", "job.phase", "job.phase", "job.progress",
                                  "job.succeeded"]
    assert [d["phase"] for t, d in got if t == "job.phase"] == ["loading_model", "training"]
    final = got[-1][1]
    assert final["status"] == "succeeded" and final["lora_sha256"] == "ab" * 32 and final["retryable"] is None


def test_the_supervisors_sqlite3_path_writes_the_same_events(hooked, hooked_db):
    job = repo.create_job(hooked_db, subscribed())
    ledger = SupervisorLedger(hooked.database_path)
    try:
        assert ledger.mark_running(job.id, phase="launching")
        assert ledger.update_running(job.id, phase="training", step=2, loss=0.1)
        assert ledger.fail_job(job.id, failure_class=FailureClass.STALLED, sentence="No progress")
    finally:
        ledger.close()
    got = events(hooked_db)
    assert [t for t, _ in got] == ["job.queued", "job.started", "job.phase", "job.progress", "job.failed"]
    assert got[-1][1]["failure_class"] == "stalled" and got[-1][1]["retryable"] is True
    assert got[-1][1]["error"].startswith("No progress")


def test_a_change_that_loses_its_compare_and_set_leaves_no_event(hooked_db):
    job = repo.create_job(hooked_db, subscribed())
    repo.transition(hooked_db, job.id, JobState.CANCELLED, actor="api")
    assert not repo.transition(hooked_db, job.id, JobState.RUNNING, actor="supervisor")
    assert not repo.update_running(hooked_db, job.id, step=5)
    assert [t for t, _ in events(hooked_db)] == ["job.queued", "job.cancelled"]


def test_an_event_that_cannot_be_written_takes_its_change_with_it(hooked, hooked_db, monkeypatch):
    """One transaction: when the outbox insert fails, the ending is not committed either."""
    job = repo.create_job(hooked_db, subscribed())
    real = outbox._INSERT_SQL
    monkeypatch.setattr(outbox, "_INSERT_SQL", real.replace("webhook_events", "no_such_table", 1))
    with pytest.raises(Exception, match="no_such_table"):
        repo.transition(hooked_db, job.id, JobState.FAILED, actor="api", failure_class="launch_error")
    assert repo.get_job(hooked_db, job.id).status == "queued"
    assert [t for t, _ in events(hooked_db)] == ["job.queued"]


def test_progress_is_coalesced_while_untried_and_written_at_most_once_per_interval(hooked_db):
    job = repo.create_job(hooked_db, subscribed())
    repo.transition(hooked_db, job.id, JobState.RUNNING, actor="supervisor", phase="training")
    for step in (1, 2, 3):
        repo.update_running(hooked_db, job.id, step=step, loss=step / 10)
    progress = [d for t, d in events(hooked_db) if t == "job.progress"]
    assert [d["step"] for d in progress] == [3]  # one event, the newest step in it
    deliver_all(hooked_db)  # the sender tried them: from here a body is what a receiver may have seen
    repo.update_running(hooked_db, job.id, step=4)
    assert [d["step"] for t, d in events(hooked_db) if t == "job.progress"] == [3]  # within the interval
    time.sleep(0.55)
    repo.update_running(hooked_db, job.id, step=5)
    assert [d["step"] for t, d in events(hooked_db) if t == "job.progress"] == [3, 5]


def test_the_terminal_events_data_is_what_get_answers(hooked, hooked_db, client_for):
    client = client_for(replace(hooked, webhook_url=None))  # a reader only: no sender of its own
    job = repo.create_job(hooked_db, subscribed())
    repo.transition(hooked_db, job.id, JobState.RUNNING, actor="supervisor", phase="training")
    repo.update_running(hooked_db, job.id, step=400, loss=0.05)
    repo.fail_job(hooked_db, job.id, actor="supervisor", failure_class=FailureClass.CUDA_OOM,
                  sentence="CUDA out of memory", exit_code=1)
    (data,) = [d for t, d in events(hooked_db) if t == "job.failed"]
    shown = client.get(f"/train/{job.id}").get_json()
    for key in ("worker_job_id", "status", "phase", "step", "total_steps", "loss", "lora_path", "lora_sha256",
                "failure_class", "retryable", "error", "exit_code", "signal", "train_id", "finished_at"):
        assert data[key] == shown[key] or key.endswith("_at") and data[key].replace("Z", "") in shown[key], key
    assert data["retryable"] is True  # states.RETRYABLE: an OOM on a card shared with TTS depends on the moment


def test_the_ledger_counts_events_by_state_for_metrics(hooked_db):
    job = repo.create_job(hooked_db, subscribed())
    repo.transition(hooked_db, job.id, JobState.CANCELLED, actor="api")
    with hooked_db.writing() as d:
        first, = outbox.due(d)
        outbox.begin_attempt(d, first.pk)
        outbox.retry_at(d, first.pk, first.give_up_at, "HTTP 500")
    conn = sqlite3.connect(hooked_db.path)
    try:
        counts = dict(conn.execute("SELECT label, n FROM job_counts WHERE metric = 'webhook' AND n != 0"))
    finally:
        conn.close()
    assert counts == {"retrying": 1, "pending": 1}
    repo.delete_jobs(hooked_db, [job.id])  # prune: its events go with it, and off the counts
    conn = sqlite3.connect(hooked_db.path)
    try:
        assert conn.execute("SELECT sum(n) FROM job_counts WHERE metric = 'webhook'").fetchone()[0] == 0
    finally:
        conn.close()


def test_a_job_reconcile_ends_sends_its_ending_too(hooked, hooked_db):
    """No supervisor holds the job's lock: reconcile fails it, and the event commits with that write."""
    from lora_worker.reconcile import reconcile

    job = repo.create_job(hooked_db, subscribed())
    repo.transition(hooked_db, job.id, JobState.RUNNING, actor="supervisor", phase="training",
                    supervisor_pid=2**22 + 1, boot_id="not-this-boot")
    reconcile(hooked_db, hooked, actor="startup")
    (data,) = [d for t, d in events(hooked_db) if t == "job.failed"]
    assert data["failure_class"] in ("host_rebooted", "supervisor_lost") and data["retryable"] is True

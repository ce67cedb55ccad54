"""`job.checkpoint`: one event per step LoRA, written by update_running_in with the checkpoints row that records
its first verification, through either ledger path; a write made again, a re-read log or a job that did not
subscribe to it sends none."""
from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.ledger.checkpoints import LORA, STATE, CheckpointRow
from lora_worker.ledger.statements import utcnow
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.states import JobState
from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.parser import Parser
from tests.helpers.fake_trainer import load_fake_trainer
from tests.helpers.ledger import columns, sql
from tests.webhooks.jobs import ALL, events
from tests.helpers.checkpoints import WatchedJob

AT = utcnow()
PATH = "/train/t1/output/ohwx-step00000150.safetensors"
SEEN = CheckpointRow(LORA, 150, PATH, AT)
VERIFIED = replace(SEEN, bytes=10, sha256="ab" * 32, verified=True)
FAILED = replace(SEEN, bytes=10, verified=False, error="ss_steps '7' instead of 150")


def running(db, subscription: outbox.Subscription = ALL) -> int:
    job = repo.create_job(db, columns(webhook_events=subscription.to_json()))
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", phase="training")
    return job.id


def checkpoint_events(db, job_id: int) -> list[dict]:
    return [d for t, d in events(db, job_id) if t == "job.checkpoint"]


@pytest.fixture(params=["repository", "supervisor"])
def write(request, hooked_db):
    """update_running through the web's SQLAlchemy path or the supervisor's sqlite3 one: the same statement."""
    if request.param == "repository":
        yield lambda job_id, **kw: repo.update_running(hooked_db, job_id, **kw)
        return
    ledger = SupervisorLedger(hooked_db.path)
    yield lambda job_id, **kw: ledger.update_running(job_id, **kw)
    ledger.close()


def test_a_step_lora_verified_is_one_event_with_the_job_and_the_checkpoint(hooked_db, write):
    job_id = running(hooked_db)
    assert write(job_id, step=150, checkpoints=[SEEN])  # seen: not complete yet, no event
    assert checkpoint_events(hooked_db, job_id) == []
    assert write(job_id, step=151, checkpoints=[VERIFIED])
    [data] = checkpoint_events(hooked_db, job_id)
    assert data["checkpoint"] == {"step": 150, "path": PATH, "bytes": 10, "sha256": "ab" * 32, "verified": True,
                                  "error": None}
    assert (data["worker_job_id"], data["status"], data["step"], data["error"]) == (job_id, "running", 151, None)


def test_the_same_verification_written_again_sends_nothing(hooked_db, write):
    """A write made again, a Slurm poller re-reading its log from the start: the same rows, no second event."""
    job_id = running(hooked_db)
    assert write(job_id, checkpoints=[VERIFIED])
    assert write(job_id, checkpoints=[VERIFIED])
    assert write(job_id, step=300, checkpoints=[SEEN, replace(VERIFIED, at=AT + timedelta(seconds=5))])
    removed = replace(SEEN, removed_at=AT)
    assert write(job_id, checkpoints=[removed])  # pruned by the trainer later: no event either
    assert len(checkpoint_events(hooked_db, job_id)) == 1


def test_a_failed_verification_is_an_event_with_its_error(hooked_db, write):
    job_id = running(hooked_db)
    assert write(job_id, checkpoints=[FAILED])
    [data] = checkpoint_events(hooked_db, job_id)
    assert data["checkpoint"] == {"step": 150, "path": PATH, "bytes": 10, "sha256": None, "verified": False,
                                  "error": "ss_steps '7' instead of 150"}
    assert write(job_id, checkpoints=[VERIFIED])  # re-checked later: the row is replaced, the event was sent
    assert len(checkpoint_events(hooked_db, job_id)) == 1


def test_a_subscription_without_job_checkpoint_sends_none(hooked_db, write):
    jobs = []
    for subscription in (replace(ALL, types=ALL.types - {"job.checkpoint"}), ALL):  # then one that takes all
        jobs.append(job_id := running(hooked_db, subscription))
        assert write(job_id, step=151, checkpoints=[VERIFIED])
        repo.transition(hooked_db, job_id, JobState.SUCCEEDED, actor="supervisor")  # the next may start
    quiet, told = jobs
    assert checkpoint_events(hooked_db, quiet) == [] and len(checkpoint_events(hooked_db, told)) == 1
    assert "job.progress" in [t for t, _ in events(hooked_db, quiet)]  # the others still go
    assert sql(hooked_db.path, "SELECT job_id, verified FROM checkpoints ORDER BY job_id") == [(quiet, 1), (told, 1)]


def test_a_removed_lora_and_a_state_send_none(hooked_db, write):
    job_id = running(hooked_db)
    later = replace(VERIFIED, step=300, path=PATH.replace("150", "300"))  # the one the trainer kept
    assert write(job_id, checkpoints=[SEEN, CheckpointRow(STATE, 150, "/o/s", AT), replace(SEEN, removed_at=AT),
                                      later])
    assert [d["checkpoint"]["step"] for d in checkpoint_events(hooked_db, job_id)] == [300]


def test_each_step_lora_of_one_write_is_its_own_event(hooked_db, write):
    job_id = running(hooked_db)
    other = replace(VERIFIED, step=300, path=PATH.replace("150", "300"))
    assert write(job_id, checkpoints=[VERIFIED, other, other])
    assert [d["checkpoint"]["step"] for d in checkpoint_events(hooked_db, job_id)] == [150, 300]


def test_a_write_the_ledger_refused_and_made_again_sends_one(hooked_db, monkeypatch):
    """The event's insert fails: the checkpoints row goes with it (one transaction); the retry writes both."""
    job_id = running(hooked_db)
    real = outbox._INSERT_SQL
    monkeypatch.setattr(outbox, "_INSERT_SQL", real.replace("webhook_events", "no_such_table", 1))
    with pytest.raises(Exception, match="no_such_table"):
        repo.update_running(hooked_db, job_id, checkpoints=[VERIFIED])
    assert sql(hooked_db.path, "SELECT count(*) FROM checkpoints") == [(0,)]
    monkeypatch.setattr(outbox, "_INSERT_SQL", real)
    assert repo.update_running(hooked_db, job_id, checkpoints=[VERIFIED])
    assert repo.update_running(hooked_db, job_id, checkpoints=[VERIFIED])
    assert len(checkpoint_events(hooked_db, job_id)) == 1


def test_a_job_no_longer_running_sends_none(hooked_db):
    job_id = running(hooked_db)
    assert repo.update_running(hooked_db, job_id, checkpoints=[VERIFIED])
    repo.transition(hooked_db, job_id, JobState.SUCCEEDED, actor="supervisor")
    later = replace(VERIFIED, step=300, path=PATH.replace("150", "300"))
    assert not repo.update_running(hooked_db, job_id, checkpoints=[later])  # a late writer: refused, no event
    assert [t for t, _ in events(hooked_db, job_id)][-2:] == ["job.checkpoint", "job.succeeded"]


# -- a log read twice: what a restarted Slurm poller does ------------------------------------------------------

FAKE = load_fake_trainer()
BAR = "\rsteps:  {pct}%|█         | {n}/9 [00:01<00:02,  3.90it/s, avr_loss=0.5]"




def test_a_log_read_again_from_the_start_by_a_new_reader_sends_no_second_event(hooked_db, tmp_path: Path):
    out = tmp_path / "output"
    out.mkdir()
    lora = out / "ohwx-step00000002.safetensors"
    FAKE.save_lora(str(lora), 4, 4.0, {"ss_network_dim": "4", "ss_output_name": "ohwx", "ss_max_train_steps": "9",
                                       "ss_seed": "42", "ss_steps": "2"}, precision="fp16")
    log = (BAR.format(pct=22, n=2) + f"\nsaving checkpoint: {lora}\n" + BAR.format(pct=33, n=3)).encode()
    job_id = running(hooked_db)
    for _ in range(2):  # the poller, then the poller started again: a fresh reader of the whole log
        parser = Parser()
        parser.feed(log)
        rows = Checkpoints(WatchedJob(str(out))).take(parser.progress, ended=False)
        assert [r.verified for r in rows] == [True]
        assert repo.update_running(hooked_db, job_id, step=3, checkpoints=rows)
    [data] = checkpoint_events(hooked_db, job_id)
    assert data["checkpoint"] == {"step": 2, "path": str(lora), "bytes": lora.stat().st_size,
                                  "sha256": hashlib.sha256(lora.read_bytes()).hexdigest(), "verified": True,
                                  "error": None}


# -- what a reader of them is told -----------------------------------------------------------------------------

def test_the_demo_receiver_and_the_openapi_describe_the_checkpoint_event():
    from lora_worker.ops.demo_webhooks import describe
    from lora_worker.web.openapi import WEBHOOKS

    ok = {"type": "job.checkpoint", "data": {"checkpoint": {"step": 150, "path": PATH, "verified": True}}}
    bad = {"type": "job.checkpoint", "data": {"checkpoint": {"step": 300, "path": PATH, "verified": False,
                                                              "error": "ss_steps '7' instead of 300"}}}
    assert describe(ok) == f"job.checkpoint step 150 verified: {PATH}"
    assert describe(bad) == f"job.checkpoint step 300 NOT verified: ss_steps '7' instead of 300: {PATH}"
    assert "job.checkpoint" in WEBHOOKS["events"]
    assert "`checkpoint`" in WEBHOOKS["body"]["properties"]["data"]["description"]

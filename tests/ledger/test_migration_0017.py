"""Migration 0017 (issue 33): `jobs` rebuilt for the `sampling` phase (0008's triggers and AUTOINCREMENT kept), its
`sample_prompts` and `promoted_step`, and the `samples` table; its rows written with a running job's progress on
both ledger paths, each pass's first write its one `job.sample` event; a promotion; up, down, up."""
from __future__ import annotations

import json
import sqlite3

import pytest
import sqlalchemy.exc
from alembic import command

from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.migrate import alembic_config, upgrade
from lora_worker.ledger.samples import SamplePass, SampleRow, promote_in
from lora_worker.ledger.statements import utcnow
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.states import JobState
from tests.helpers.ledger import columns, running_job, sql, triggers

AT = utcnow()
SUBSCRIBED = outbox.Subscription(frozenset({"job.sample", "job.promoted"}), 30.0).to_json()


def image(step: int, index: int) -> SampleRow:
    return SampleRow(f"ohwx_{step:06d}_{index:02d}_20261206051027_{42 + index}.png", step, index, 42 + index, 768,
                     768, 1000, "cd" * 32, AT)


def test_up_down_up_keeps_rows_triggers_ids_and_says_sampling_was_training(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    upgrade(path, "0016")
    before = triggers(path)
    upgrade(path, "0017")
    assert triggers(path) == before
    assert "AUTOINCREMENT" in sql(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'")[0][0]
    db = Database.open(path)
    try:
        job = repo.create_job(db, columns(sample_prompts=[{"prompt": "p", "seed": 1}]))
        repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", phase="sampling")
        assert repo.get_job(db, job.id).sample_prompts == [{"prompt": "p", "seed": 1}]
    finally:
        db.dispose()
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        sql(path, "UPDATE jobs SET phase = 'dreaming' WHERE id = ?", job.id)
    command.downgrade(alembic_config(path), "0016")
    assert triggers(path) == before and sql(path, "SELECT phase FROM jobs") == [("training",)]
    assert not sql(path, "SELECT name FROM sqlite_master WHERE name = 'samples'")
    upgrade(path, "0017")
    db = Database.open(path)
    try:
        again = repo.create_job(db, columns(slot="slurm-1", lora_file="/x.safetensors"))
        assert again.id == job.id + 1 and again.sample_prompts is None and again.promoted_step is None
    finally:
        db.dispose()


def test_a_pass_is_written_with_the_progress_once_and_tells_its_event_once(db):
    job_id = running_job(db)
    sql(db.path, "UPDATE jobs SET webhook_events = ? WHERE id = ?", SUBSCRIBED, job_id)
    first = SamplePass(100, (image(100, 0), image(100, 1)), 2, {"step": 100, "verified": True})
    ledger = SupervisorLedger(db.path)
    try:
        assert ledger.update_running(job_id, step=101, samples=[first])
        assert ledger.update_running(job_id, step=102, samples=[first])  # written again: a refused write, a re-read
    finally:
        ledger.close()
    assert repo.update_running(db, job_id, step=200, samples=[SamplePass(200, (image(200, 0),), 2)])  # the web's path
    assert sql(db.path, "SELECT step, prompt_index, name FROM samples ORDER BY id") == [
        (100, 0, image(100, 0).name), (100, 1, image(100, 1).name), (200, 0, image(200, 0).name)]
    with db.reading() as d:
        bodies = [json.loads(b) for _, b in outbox.bodies(d, job_id)]
    sample = [b["data"]["sample"] for b in bodies if b["type"] == "job.sample"]
    assert [(s["step"], s["expected"], len(s["images"]), s["lora"]) for s in sample] == [
        (100, 2, 2, {"step": 100, "verified": True}), (200, 2, 1, None)]
    assert sample[0]["images"][1] == {"name": image(100, 1).name, "step": 100, "prompt_index": 1, "seed": 43,
                                      "width": 768, "height": 768, "bytes": 1000, "sha256": "cd" * 32}


def test_a_pass_without_images_is_no_row_and_no_event_and_a_finished_job_takes_none(db):
    job_id = running_job(db)
    sql(db.path, "UPDATE jobs SET webhook_events = ? WHERE id = ?", SUBSCRIBED, job_id)
    assert repo.update_running(db, job_id, samples=[SamplePass(100, (), 1)])
    repo.transition(db, job_id, JobState.SUCCEEDED, actor="supervisor")
    assert not repo.update_running(db, job_id, samples=[SamplePass(200, (image(200, 0),), 1)])
    assert sql(db.path, "SELECT count(*) FROM samples") == [(0,)]
    with db.reading() as d:
        assert not [b for _, b in outbox.bodies(d, job_id) if '"job.sample"' in b]


def test_a_promotion_changes_a_succeeded_jobs_result_only_with_its_event(db):
    job_id = running_job(db)
    sql(db.path, "UPDATE jobs SET webhook_events = ? WHERE id = ?", SUBSCRIBED, job_id)
    with db.writing() as d:
        assert not promote_in(d, job_id, step=100, path="/o/s.safetensors", sha256="ab" * 32, size=9, actor="api")
    repo.transition(db, job_id, JobState.SUCCEEDED, actor="supervisor", lora_path="/o/ohwx.safetensors")
    with db.writing() as d:
        assert promote_in(d, job_id, step=100, path="/o/s.safetensors", sha256="ab" * 32, size=9, actor="api")
    job = repo.get_job(db, job_id)
    assert (job.status, job.lora_path, job.lora_sha256, job.lora_size, job.promoted_step) == (
        "succeeded", "/o/s.safetensors", "ab" * 32, 9, 100)
    with db.reading() as d:
        [body] = [json.loads(b) for _, b in outbox.bodies(d, job_id) if '"job.promoted"' in b]
    assert body["data"]["promoted"] == {"step": 100, "path": "/o/s.safetensors", "sha256": "ab" * 32, "bytes": 9}
    assert (body["data"]["lora_path"], body["data"]["promoted_step"]) == ("/o/s.safetensors", 100)


def test_rows_go_with_their_job_and_a_name_is_one_row_per_job(db):
    job_id = running_job(db)
    assert repo.update_running(db, job_id, samples=[SamplePass(100, (image(100, 0), image(100, 0)), 1)])
    assert sql(db.path, "SELECT count(*) FROM samples") == [(1,)]
    with pytest.raises(sqlalchemy.exc.IntegrityError):
        sql_insert = "INSERT INTO samples (job_id, name, step, prompt_index, width, height, bytes, sha256, at) " \
                     "VALUES (?, 'x.png', 1, 0, 64, 64, 1, 'ab', 'now')"
        with db.write() as s:
            s.execute(sqlalchemy.text(sql_insert.replace("?", str(job_id + 999))))
    conn = sqlite3.connect(db.path)
    try:
        with conn:
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))  # what prune does
    finally:
        conn.close()
    assert sql(db.path, "SELECT count(*) FROM samples") == [(0,)]

"""POST /train/<id>/resume: a new row linked to the original, idempotent with an Idempotency-Key, 409 while a job
is active, 422 with the reasons when no state passes; admitted and launched as POST /train's jobs are."""
from __future__ import annotations

import pytest

from lora_worker.dispatch.refingerprint import without_resume_flags
from lora_worker.ledger import repository as repo
from lora_worker.states import FailureClass, JobState
from tests.helpers import job_rows
from tests.helpers.states import interrupted


def submit(api, host) -> int:
    response = api.post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()
    return response.get_json()["worker_job_id"]


def test_a_resume_is_a_new_row_linked_to_the_original_and_launched(api, host, db, launches):
    original = submit(api, host)
    output = interrupted(db, host.settings, original)
    answer = api.post(f"/train/{original}/resume")
    assert answer.status_code == 202, answer.get_json()
    body = answer.get_json()
    new = body["worker_job_id"]
    assert body["resumed_from"] == original and body["attempt"] == 2 and body["resume_step"] == 4
    assert launches == [original, new]  # the dispatcher's one launch path
    before, after = repo.get_job(db, original), repo.get_job(db, new)
    state = str(output / "ohwx_lora-step00000004-state")
    # a resume never samples at first: its pass would draw the state's weights under the base model's name
    assert before.argv[-1] == "--sample_at_first"
    assert after.argv == [*before.argv[:-1], f"--resume={state}", "--skip_until_initial_step"]
    assert after.sample_prompts == before.sample_prompts  # its passes draw the same prompts, in the same file
    assert (after.lora_file, after.output_dir, after.total_steps, after.seed) == (
        before.lora_file, before.output_dir, before.total_steps, before.seed)
    assert after.output_dev_ino == before.output_dev_ino and after.status == JobState.QUEUED.value
    status = api.get(f"/train/{new}").get_json()
    assert (status["resumed_from"], status["attempt"], status["resume_step"]) == (original, 2, 4)
    assert any("resumed as job" in (e.reason or "") for e in repo.job_events(db, original))
    # the dataset lint's warnings of the original ride along: the resume trains the same dataset
    assert status["warnings"] == api.get(f"/train/{original}").get_json()["warnings"] != []


def test_the_verdict_is_readable_before(api, host, db):
    original = submit(api, host)
    interrupted(db, host.settings, original)
    body = api.get(f"/train/{original}/resume").get_json()
    assert body["resumable"] is True and body["from_step"] == 4 and body["reasons"] == []
    assert body["state"].endswith("ohwx_lora-step00000004-state") and body["worker_job_id"] == original


def test_the_same_key_returns_the_resume_it_started(api, host, db, launches):
    original = submit(api, host)
    interrupted(db, host.settings, original)
    first = api.post(f"/train/{original}/resume", headers={"Idempotency-Key": "resume-1"})
    again = api.post(f"/train/{original}/resume", headers={"Idempotency-Key": "resume-1"})
    assert first.status_code == 202 and again.status_code == 200
    assert first.get_json()["worker_job_id"] == again.get_json()["worker_job_id"]
    assert job_rows(host.settings) == 2 and len(launches) == 2


def test_a_key_of_post_train_is_not_a_resumes(api, host, db):
    response = api.post("/train", json=host.payload(), headers={"Idempotency-Key": "k"})
    original = response.get_json()["worker_job_id"]
    interrupted(db, host.settings, original)
    answer = api.post(f"/train/{original}/resume", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 422 and answer.get_json()["error"] == "idempotency_key_reused"


def test_a_second_resume_without_a_key_is_refused_naming_the_first(api, host, db):
    original = submit(api, host)
    interrupted(db, host.settings, original)
    first = api.post(f"/train/{original}/resume").get_json()["worker_job_id"]
    # the first resume ran and failed (one that never ran counts as no resume: tests/dispatch/test_resume_retry.py)
    repo.fail_job(db, first, actor="test", failure_class=FailureClass.STALLED, sentence="x")
    answer = api.post(f"/train/{original}/resume")
    body = answer.get_json()
    assert answer.status_code == 422 and body["error"] == "not_resumable"
    assert body["details"]["resumed_by"] == first and body["details"]["reasons"][0]["code"] == "already_resumed"


def test_an_active_job_is_a_409(api, host):
    original = submit(api, host)
    answer = api.post(f"/train/{original}/resume")
    assert answer.status_code == 409 and answer.get_json()["error"] == "job_active"


def test_another_active_job_is_a_409(api, host, db):
    original = submit(api, host)
    interrupted(db, host.settings, original)
    other = api.post("/train", json=host.payload(output_dir=str(host.settings.train_root / "t1" / "output2")))
    assert other.status_code == 202, other.get_json()
    answer = api.post(f"/train/{original}/resume")
    assert answer.status_code == 409 and answer.get_json()["error"] == "job_active"
    assert job_rows(host.settings) == 2


def test_no_good_state_is_a_422_with_the_reasons(api, host, db, launches):
    original = submit(api, host)
    output = interrupted(db, host.settings, original, steps=(2,))
    (output / "ohwx_lora-step00000002-state" / "optimizer.bin").write_bytes(b"PK\x03\x04 cut short")
    answer = api.post(f"/train/{original}/resume")
    body = answer.get_json()
    assert answer.status_code == 422 and body["error"] == "not_resumable" and body["retryable"] is False
    assert [r["code"] for r in body["details"]["reasons"]] == ["state_archive_corrupt"]
    assert job_rows(host.settings) == 1 and launches == [original]


def test_a_cancelled_job_is_a_422(api, host, db):
    original = submit(api, host)
    repo.request_cancel(db, original, actor="test")
    answer = api.post(f"/train/{original}/resume")
    assert answer.status_code == 422 and answer.get_json()["details"]["reasons"][0]["code"] == "job_cancelled"


def test_an_unknown_job_is_a_404(api):
    assert api.get("/train/99/resume").status_code == 404
    assert api.post("/train/99/resume").status_code == 404


def test_the_openapi_document_has_both_routes(api):
    paths = api.get("/openapi.json").get_json()["paths"]
    assert set(paths["/train/{job_id}/resume"]) == {"get", "post"}
    post = paths["/train/{job_id}/resume"]["post"]
    assert "202" in post["responses"] and "not_resumable" in str(post["responses"])


@pytest.mark.parametrize("samples", [[], None])
def test_a_resumes_disk_preflight_counts_the_state_it_finds_once(api, host, db, launches, monkeypatch, samples):
    """The run it continues kept a state and a step LoRA there, which its own first save replaces: a resume needs
    one state and one step LoRA less free space than the job (docs/resume.md, "What states cost"); with samples (the
    default prompt), it counts the step LoRAs and images of the steps it has left, not the whole run's."""
    from lora_worker.config_tables import STATE_MIB, STEP_LORA_MIB
    from lora_worker.dispatch import dispatcher
    from lora_worker.dispatch.disk import required_mib
    from lora_worker.dispatch.samples import disk_counts, resolve_samples

    needs: list[int] = []
    real = dispatcher.require_free_space
    monkeypatch.setattr(dispatcher, "require_free_space", lambda path, need: (needs.append(need), real(path, need)))
    body = {**host.payload(), **({"samples": samples} if samples is not None else {})}
    response = api.post("/train", json=body)
    assert response.status_code == 202, response.get_json()
    original = response.get_json()["worker_job_id"]
    interrupted(db, host.settings, original)
    answer = api.post(f"/train/{original}/resume")
    assert answer.status_code == 202, answer.get_json()
    if samples == []:
        assert needs[0] - needs[1] == STATE_MIB[16] + STEP_LORA_MIB[16] and needs[1] > 0
        return
    job, resumed = repo.get_job(db, original), repo.get_job(db, answer.get_json()["worker_job_id"])
    prompts = resolve_samples(None, job.trigger, job.subject_class)
    every = host.settings.save_every_n_steps(job.tier)
    left = disk_counts(prompts, job.lora_steps - resumed.resume_step, every)
    assert left != disk_counts(prompts, job.lora_steps, every)  # the steps left draw fewer passes
    assert needs[1] == required_mib(host.settings.disk_mib[job.tier], 16, **left, resuming=True)


def test_a_row_accepted_before_the_dataset_config_resumes_with_the_folders_repeats(api, host, db, launches):
    """Its argv named `--train_data_dir`: its resume rebuilds that argv (the fingerprint holds), keeps it, and
    writes no config."""
    import json
    import sqlite3

    original = submit(api, host)
    conn = sqlite3.connect(host.settings.database_path)
    with conn:
        (argv,) = conn.execute("SELECT argv FROM jobs WHERE id = ?", (original,)).fetchone()
        legacy = [f"--train_data_dir={host.dataset}" if a.startswith("--dataset_config=") else a
                  for a in json.loads(argv)]
        conn.execute("UPDATE jobs SET argv = ? WHERE id = ?", (json.dumps(legacy), original))
    conn.close()
    for config in (host.settings.state_dir / "datasets").iterdir():
        config.unlink()
    interrupted(db, host.settings, original)
    answer = api.post(f"/train/{original}/resume")
    assert answer.status_code == 202, answer.get_json()
    resumed = repo.get_job(db, answer.get_json()["worker_job_id"])
    assert without_resume_flags(resumed.argv) == without_resume_flags(legacy)
    assert not any(a.startswith("--dataset_config=") for a in resumed.argv)
    assert list((host.settings.state_dir / "datasets").iterdir()) == []


def test_a_resume_writes_its_config_again_when_retention_removed_it(api, host, db, launches):
    original = submit(api, host)
    (config,) = list((host.settings.state_dir / "datasets").iterdir())
    content = config.read_bytes()
    config.unlink()
    interrupted(db, host.settings, original)
    answer = api.post(f"/train/{original}/resume")
    assert answer.status_code == 202, answer.get_json()
    assert config.read_bytes() == content
    assert f"--dataset_config={config}" in repo.get_job(db, answer.get_json()["worker_job_id"]).argv

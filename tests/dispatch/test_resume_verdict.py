"""GET /train/<id>/resume's checks, one by one: each refusal reason made to happen, and the newest state that
passes chosen (dispatch/resumable.py, host/train_state.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3

import pytest

from lora_worker.dispatch import resumable
from lora_worker.dispatch.resumable import ENDINGS, verdict
from lora_worker.errors import RESUME_REASONS
from lora_worker.host import state_archives, train_state
from lora_worker.ledger import repository as repo
from lora_worker.ledger import resumes
from lora_worker.states import FailureClass, JobState
from tests.helpers.states import interrupted, log_saves, write_state, write_step_lora


@pytest.fixture
def job_id(api, host) -> int:
    response = api.post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()
    return response.get_json()["worker_job_id"]


def codes(found) -> list[str]:
    return [p.code for p in found.reasons]


def check(db, settings, job_id: int, **kw):
    return verdict(db, settings, repo.get_job(db, job_id), **kw)


def set_column(settings, job_id: int, **values) -> None:
    conn = sqlite3.connect(settings.database_path)
    with conn:
        for column, value in values.items():
            conn.execute(f"UPDATE jobs SET {column} = ? WHERE id = ?", (value, job_id))
    conn.close()


def test_the_newest_state_that_passes_is_chosen(db, settings, job_id):
    output = interrupted(db, settings, job_id)
    found = check(db, settings, job_id)
    assert found.resumable and found.from_step == 4 and found.reasons == []
    assert found.state == str(output / "ohwx_lora-step00000004-state")


def test_every_failure_class_is_mapped_explicitly():
    assert set(ENDINGS) == set(FailureClass)


@pytest.mark.parametrize("failure", sorted(FailureClass, key=lambda f: f.value))
def test_each_failure_class_is_resumed_or_refused_as_mapped(db, settings, job_id, failure):
    interrupted(db, settings, job_id, failure)
    found = check(db, settings, job_id)
    if ENDINGS[failure]:
        assert found.resumable, found.reasons
    else:
        assert not found.resumable and codes(found) == ["failure_recurs"]


def test_an_active_job_is_not_resumed(db, settings, job_id):
    assert codes(check(db, settings, job_id)) == ["job_not_ended"]


def test_a_succeeded_job_is_not_resumed(db, settings, job_id):
    repo.transition(db, job_id, JobState.RUNNING, actor="test")
    repo.transition(db, job_id, JobState.SUCCEEDED, actor="test")
    assert codes(check(db, settings, job_id)) == ["job_succeeded"]


def test_a_cancelled_job_is_never_resumed(db, settings, job_id):
    repo.request_cancel(db, job_id, actor="test")
    assert codes(check(db, settings, job_id)) == ["job_cancelled"]


def test_no_state_is_refused(db, settings, job_id):
    interrupted(db, settings, job_id, steps=())
    assert codes(check(db, settings, job_id)) == ["no_state"]


def newest(output):
    return output / "ohwx_lora-step00000004-state"


@pytest.mark.parametrize("damage, code", [
    (lambda s: (s / "optimizer.bin").unlink(), "state_incomplete"),
    (lambda s: (s / "train_state.json").unlink(), "state_incomplete"),
    (lambda s: ((s / "scheduler.bin").unlink(), os.symlink("/etc/passwd", s / "scheduler.bin")), "state_file_invalid"),
    (lambda s: ((s / "random_states_0.pkl").unlink(), os.mkfifo(s / "random_states_0.pkl")), "state_file_invalid"),
    (lambda s: (s / "train_state.json").write_text("{not json"), "state_json_invalid"),
    (lambda s: (s / "train_state.json").write_text('{"current_step": "4", "current_epoch": 1}'),
     "state_json_invalid"),
    (lambda s: (s / "train_state.json").write_text('{"current_step": 3, "current_epoch": 1}'),
     "state_step_mismatch"),
    (lambda s: os.truncate(s / "model.safetensors", os.path.getsize(s / "model.safetensors") - 100),
     "state_model_invalid"),
    (lambda s: os.truncate(s / "optimizer.bin", os.path.getsize(s / "optimizer.bin") - 40), "state_archive_corrupt"),
])
def test_a_damaged_newest_state_is_refused_and_the_older_one_used(db, settings, job_id, damage, code):
    output = interrupted(db, settings, job_id)
    damage(newest(output))
    found = check(db, settings, job_id)
    assert found.resumable and found.from_step == 2
    assert codes(found) == [code] and "ohwx_lora-step00000004-state" in found.reasons[0].message


def test_a_member_whose_crc_fails_is_refused(db, settings, job_id):
    output = interrupted(db, settings, job_id, steps=(2,))
    path = output / "ohwx_lora-step00000002-state" / "scheduler.bin"
    data = bytearray(path.read_bytes())
    at = bytes(data).index(b"\x80\x02}q") + 5  # inside the stored data.pkl member
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    found = check(db, settings, job_id)
    assert not found.resumable and codes(found) == ["state_archive_corrupt"] and "CRC" in found.reasons[0].message


def test_a_state_of_another_rank_is_refused(db, settings, job_id):
    output = interrupted(db, settings, job_id, steps=(2,))
    shutil.rmtree(output / "ohwx_lora-step00000002-state")
    write_state(output, "ohwx_lora", 2, rank=8)
    found = check(db, settings, job_id)
    assert codes(found) == ["state_model_invalid"] and "rank [8]" in found.reasons[0].message


def test_archives_past_the_bound_are_not_verified(db, settings, job_id, monkeypatch):
    interrupted(db, settings, job_id, steps=(2,))
    monkeypatch.setattr(state_archives, "MAX_ARCHIVE_BYTES", 100)
    found = check(db, settings, job_id)
    assert codes(found) == ["state_unverifiable"] and "more than 100 bytes" in found.reasons[0].message


def test_a_check_past_its_time_is_not_verified(db, settings, job_id, monkeypatch):
    interrupted(db, settings, job_id, steps=(2,))
    monkeypatch.setattr(state_archives, "MAX_CHECK_S", -1.0)
    assert codes(check(db, settings, job_id)) == ["state_unverifiable"]


def test_a_state_the_run_never_said_it_saved_is_refused(db, settings, job_id):
    output = interrupted(db, settings, job_id)
    write_state(output, "ohwx_lora", 6)  # planted: no `saving state at step 6` in the run's output
    found = check(db, settings, job_id)
    assert found.from_step == 4 and codes(found) == ["state_not_seen"]


def as_accepted_before_issue_32(settings, job_id: int) -> None:
    """The row as dispatch wrote it before the dataset config: `--train_data_dir`, the folder's own repeats."""
    conn = sqlite3.connect(settings.database_path)
    with conn:
        (argv,) = conn.execute("SELECT argv FROM jobs WHERE id = ?", (job_id,)).fetchone()
        argv = [f"--train_data_dir={row_dataset(conn, job_id)}" if a.startswith("--dataset_config=") else a
                for a in json.loads(argv)]
        conn.execute("UPDATE jobs SET argv = ? WHERE id = ?", (json.dumps(argv), job_id))
    conn.close()


def row_dataset(conn, job_id: int) -> str:
    return conn.execute("SELECT dataset_dir FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]


def test_a_state_past_the_first_epoch_of_a_row_accepted_before_is_refused(db, settings, job_id):
    """A row given `--train_data_dir` trained on the folder's 10 repeats: 3 images × 10 / batch 2 is 15 steps an
    epoch, and its resume (which rebuilds the same argv) keeps that rule."""
    as_accepted_before_issue_32(settings, job_id)
    output = interrupted(db, settings, job_id)
    job = repo.get_job(db, job_id)
    assert job.image_count * job.repeats == 30 and "--train_batch_size=2" in job.argv  # an epoch: 15 steps
    write_state(output, "ohwx_lora", 15, epoch=1)  # the first step of epoch 2 is 16: 15 is epoch 1's last
    write_state(output, "ohwx_lora", 14)  # the last step of epoch 1
    log_saves(settings, job_id, 14, 15)
    found = check(db, settings, job_id)
    assert found.from_step == 14 and codes(found) == ["state_past_first_epoch"]
    assert "3 images × 10 repeats / batch size 2" in found.reasons[0].message


def test_a_job_presented_one_epoch_resumes_from_a_state_past_where_its_folders_repeats_ended_an_epoch(
        db, settings, job_id):
    """The same request accepted now: its config shows sd-scripts 267 repeats (3 × 267 / 2 ≥ 400 steps), so the
    state of step 300 (past the folder's 15-step epoch, 20 epochs in) is inside its one epoch."""
    output = interrupted(db, settings, job_id)
    write_state(output, "ohwx_lora", 300)
    log_saves(settings, job_id, 300)
    found = check(db, settings, job_id)
    assert found.resumable and found.from_step == 300 and found.reasons == []
    shown = resumable.presentation_of(repo.get_job(db, job_id))
    assert shown is not None and (shown.repeats, shown.steps_per_epoch, shown.epochs) == (267, 401, 1)
    assert all(state.resumable for state in shown.states[:-1])


def test_a_state_at_the_last_step_is_refused(db, settings, job_id):
    interrupted(db, settings, job_id)
    set_column(settings, job_id, total_steps=4)
    found = check(db, settings, job_id)
    assert found.from_step == 2 and codes(found) == ["state_at_last_step"]


def test_a_resumed_job_is_not_resumed_twice(api, db, settings, job_id):
    interrupted(db, settings, job_id)
    assert api.post(f"/train/{job_id}/resume").status_code == 202
    assert codes(check(db, settings, job_id)) == ["already_resumed"]


def test_a_replaced_output_dir_is_refused(db, settings, job_id):
    output = interrupted(db, settings, job_id)
    output.rename(output.with_name("moved"))
    shutil.copytree(output.with_name("moved"), output)
    assert codes(check(db, settings, job_id)) == ["output_dir_replaced"]


def test_a_file_at_the_loras_path_is_refused(db, settings, job_id):
    output = interrupted(db, settings, job_id)
    (output / "ohwx_lora.safetensors").write_bytes(b"half a save")
    assert codes(check(db, settings, job_id)) == ["lora_file_exists"]


def test_changed_settings_change_the_argv(db, settings, job_id):
    interrupted(db, settings, job_id)
    found = check(db, settings.with_overrides(cpu_threads=settings.cpu_threads + 1), job_id)
    assert codes(found) == ["fingerprint_argv"]


def test_another_batch_size_is_refused(db, settings, job_id):
    interrupted(db, settings, job_id)
    job = repo.get_job(db, job_id)
    device = settings.devices[job.device_index]
    more = dataclasses.replace(device, train_batch_size=device.train_batch_size + 1)
    bigger = {**settings.devices, job.device_index: more}
    found = check(db, settings.with_overrides(devices=bigger), job_id)
    assert "fingerprint_batch_size" in codes(found) and "fingerprint_argv" in codes(found)


def test_a_changed_dataset_is_refused(db, settings, host, job_id):
    interrupted(db, settings, job_id)
    caption = next((host.dataset / "10_ohwx woman").glob("*.txt"))
    caption.write_text("ohwx woman, another caption")
    assert codes(check(db, settings, job_id)) == ["fingerprint_dataset"]


def test_a_modified_base_model_is_refused(db, settings, host, job_id):
    interrupted(db, settings, job_id)
    os.utime(host.model, ns=(1, 1))
    assert codes(check(db, settings, job_id)) == ["fingerprint_base_model"]


def test_step_loras_naming_other_base_models_are_refused(db, settings, job_id):
    output = interrupted(db, settings, job_id)
    (output / "ohwx_lora-step00000002.safetensors").unlink()
    write_step_lora(output, "ohwx_lora", 2, "b" * 64)
    assert codes(check(db, settings, job_id)) == ["fingerprint_base_model"]


def test_another_sd_scripts_commit_is_refused(db, settings, job_id):
    interrupted(db, settings, job_id)
    (settings.sd_scripts_dir / ".git" / "refs" / "heads" / "sd3").write_text("1" * 40 + "\n")
    assert codes(check(db, settings, job_id)) == ["fingerprint_trainer"]


def test_a_job_without_a_recorded_base_model_identity_is_refused(db, settings, job_id):
    interrupted(db, settings, job_id)
    set_column(settings, job_id, base_model_identity=None)
    assert codes(check(db, settings, job_id)) == ["fingerprint_unknown"]


def test_the_saves_the_resumed_job_saw_count_for_its_resume(db, settings, job_id):
    """A resume that died before its first save leaves its original's state: the original's run saw it."""
    interrupted(db, settings, job_id)
    seen = {job_id: {2, 4}}
    found = check(db, settings, job_id, seen=lambda s, j: seen.get(j.id, set()))
    assert found.from_step == 4
    assert resumes.states_seen(db, job_id) == {2, 4}  # what the verdict reads when not told otherwise


def test_every_reason_is_in_the_catalogue():
    import inspect

    source = inspect.getsource(resumable) + inspect.getsource(train_state) + inspect.getsource(
        __import__("lora_worker.dispatch.refingerprint", fromlist=["x"])) + inspect.getsource(state_archives)
    import re

    said = set(re.findall(r'"((?:state|fingerprint|job|no|failure|already|output|lora)_[a-z_]+)"', source))
    assert said <= set(RESUME_REASONS), said - set(RESUME_REASONS)


def test_a_final_lora_whose_ss_steps_is_not_the_steps_asked_fails_verification(tmp_path):
    """After a resume that miscounted, sd-scripts writes the global_step it ended at: held to the row."""
    from lora_worker.host.safetensors import verify_lora
    from lora_worker.ledger.models import Job
    from lora_worker.transcript.outcome import recorded_lora
    from tests.helpers.states import lora_tensors
    from tests.helpers import write_safetensors

    path = tmp_path / "ohwx.safetensors"
    md = {"ss_network_dim": "16", "ss_output_name": "ohwx", "ss_max_train_steps": "400", "ss_seed": "7"}
    write_safetensors(path, lora_tensors(16), {**md, "ss_steps": "250"})
    job = Job(output_name="ohwx", seed=7, lora_rank=16, lora_steps=400, lora_dtype="F32")
    check = verify_lora(path, recorded_lora(job))
    assert check.mismatch and "ss_steps '250' instead of 400" in (check.problem or "")
    path.unlink()
    write_safetensors(path, lora_tensors(16), {**md, "ss_steps": "400"})
    assert verify_lora(path, recorded_lora(job)).problem is None

"""A run SIGKILLed (its whole process group) after its second state, resumed through the API, ends `succeeded`
with a verified LoRA, having trained exactly max_train_steps steps over both attempts (the fake trainer's
optimizer steps, counted in both run logs); a second interruption, of the resume, and its resume end right too;
a state truncated by hand is refused with a reason. The fake trainer keeps sd-scripts' resume arithmetic
(tests/fakes/sdxl_train_network.py `initial_step_of`, `training`)."""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from lora_worker.host.safetensors import read_header
from lora_worker.ledger import repository as repo
from tests.helpers import make_dataset, set_modes, wait_for
from tests.helpers.runs import wait_state, wait_states_removed

pytestmark = pytest.mark.slow

BAR = re.compile(r"steps:[^|\n\r]*\|[^|\n\r]*\| (\d+)/(\d+)")
STEPS = 400  # the fast tier; a state every 150 steps, the newest kept


def bar_steps(settings, job_id: int) -> int:
    """The optimizer steps the trainer's bar counted in this attempt's run log."""
    text = (settings.log_dir / f"job-{job_id}.log").read_text(errors="replace")
    return max((int(n) for n, _ in BAR.findall(text)), default=0)


@pytest.fixture
def one_epoch(host):
    """8 images × 100 repeats at batch size 2: one epoch of 400 steps covers the whole run."""
    dataset = make_dataset(host.settings.train_root, "t2", folder="100_ohwx woman", images=8)
    return host.payload(dataset_dir=str(dataset), output_dir=str(dataset.parent / "output"), repeats=100)


def held_at(host, step: int) -> None:
    set_modes(host.sd_scripts, hold_at_step=step + 1, release_file=str(host.root / "never"))


def kill_after(client, db, host, job_id: int, step: int) -> None:
    """Wait until the trainer holds after `step` (its state, if any, written whole), then SIGKILL its group."""
    job = repo.get_job(db, job_id)
    wait_for(lambda: repo.get_job(db, job_id).step == step, timeout=60, what=f"step {step}")
    wait_for(lambda: f"saving state at step {step}" not in _log(host, job_id) or "Random states saved"
             in _log(host, job_id).rsplit(f"saving state at step {step}", 1)[1], timeout=30, what="the state")
    pgid = repo.get_job(db, job_id).trainer_pid
    assert pgid and job.output_dir
    os.killpg(pgid, signal.SIGKILL)
    body = wait_state(client, job_id, "failed", timeout=30)
    assert body["failure_class"] == "killed_by_signal"


def _log(host, job_id: int) -> str:
    path = host.settings.log_dir / f"job-{job_id}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def resume(client, job_id: int) -> int:
    answer = client.post(f"/train/{job_id}/resume", headers={"Idempotency-Key": f"resume-{job_id}"})
    assert answer.status_code == 202, answer.get_json()
    return answer.get_json()["worker_job_id"]


def assert_succeeded(client, db, host, job_id: int) -> dict:
    body = wait_state(client, job_id, "succeeded", "failed", timeout=60)
    assert body["status"] == "succeeded", body
    assert (body["step"], body["total_steps"]) == (STEPS, STEPS) and body["lora_sha256"]
    assert read_header(Path(body["lora_path"])).metadata["ss_steps"] == str(STEPS)
    wait_states_removed(Path(body["output_dir"]))
    return body


def test_killed_after_its_second_state_a_resume_ends_right(client, db, host, one_epoch):
    held_at(host, 300)
    first = client.post("/train", json=one_epoch).get_json()["worker_job_id"]
    kill_after(client, db, host, first, 300)
    verdict = client.get(f"/train/{first}/resume").get_json()
    assert verdict["resumable"] and verdict["from_step"] == 300, verdict
    set_modes(host.sd_scripts)
    second = resume(client, first)
    body = assert_succeeded(client, db, host, second)
    assert (body["resumed_from"], body["attempt"], body["resume_step"]) == (first, 2, 300)
    assert bar_steps(host.settings, first) + bar_steps(host.settings, second) == STEPS  # 300 + 100
    assert "skipping 300 steps" in _log(host, second)


def test_a_resume_cut_off_in_turn_resumes_from_the_same_state_and_ends_right(client, db, host, one_epoch):
    held_at(host, 300)
    first = client.post("/train", json=one_epoch).get_json()["worker_job_id"]
    kill_after(client, db, host, first, 300)
    held_at(host, 350)
    second = resume(client, first)
    kill_after(client, db, host, second, 350)  # no state of its own yet: its original's is still the newest
    verdict = client.get(f"/train/{second}/resume").get_json()
    assert verdict["resumable"] and verdict["from_step"] == 300, verdict
    set_modes(host.sd_scripts)
    third = resume(client, second)
    body = assert_succeeded(client, db, host, third)
    assert (body["resumed_from"], body["attempt"]) == (second, 3)
    assert bar_steps(host.settings, first) + bar_steps(host.settings, third) == STEPS


def test_a_state_truncated_by_hand_is_refused(client, db, host, one_epoch):
    held_at(host, 300)
    first = client.post("/train", json=one_epoch).get_json()["worker_job_id"]
    kill_after(client, db, host, first, 300)
    state = Path(repo.get_job(db, first).output_dir) / "ohwx_lora-step00000300-state"
    os.truncate(state / "optimizer.bin", os.path.getsize(state / "optimizer.bin") // 2)
    verdict = client.get(f"/train/{first}/resume").get_json()
    assert not verdict["resumable"] and [r["code"] for r in verdict["reasons"]] == ["state_archive_corrupt"]
    answer = client.post(f"/train/{first}/resume")
    assert answer.status_code == 422 and answer.get_json()["error"] == "not_resumable"


def test_the_samples_survive_a_resume_each_with_the_step_lora_of_the_run_that_drew_it(client, db, host, one_epoch):
    """The original draws the passes before the first step and at 100 and 200 and is killed at 250; its resume
    (from the state at 200) draws 300 and 400 and never the base model again. The resume's listing holds all five,
    each tied to the step LoRA its own run saved right after the pass, and any of them can be promoted."""
    held_at(host, 250)
    first = client.post("/train", json=one_epoch).get_json()["worker_job_id"]
    kill_after(client, db, host, first, 250)
    set_modes(host.sd_scripts)
    second = resume(client, first)
    assert "--sample_at_first" not in repo.get_job(db, second).argv
    assert_succeeded(client, db, host, second)
    images = client.get(f"/train/{second}/samples").get_json()["images"]
    assert [(i["step"], i["job_id"]) for i in images] == [(0, first), (100, first), (200, first), (300, second),
                                                          (400, second)]
    rows = {(c.job_id, c.step): c for j in (first, second) for c in repo.get_job(db, j).checkpoints
            if c.kind == "lora"}
    for image in images[1:]:
        saved = rows[(image["job_id"], image["step"])]
        assert (image["lora"]["sha256"], image["lora"]["job_id"], image["lora"]["verified"]) == (
            saved.sha256, image["job_id"], True)
    assert client.get(f"/train/{first}/samples").get_json()["images"] == images[:3]  # the original's own
    answer = client.post(f"/train/{second}/promote", json={"step": 100})  # a step LoRA of the original's run
    assert answer.status_code == 200 and answer.get_json()["lora_sha256"] == rows[(first, 100)].sha256

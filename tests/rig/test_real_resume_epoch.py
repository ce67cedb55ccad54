"""Issue 32 on the REAL trainer, through the worker (the API, the detached supervisor, the sandbox, sd-scripts from
the CPU rig): a job shaped like the small datasets of the issue's table, whose states lay past the first epoch of
its folder's repeats, resumes right because the worker presents one epoch covering the run.

3 images in `2_ohwx dog` (the folder's 2 repeats: 6 steps an epoch at batch 1, so the state of step 8 is in epoch 2
and main refused it, `state_past_first_epoch`), the `fast` tier shrunk by the test's own settings to 10 steps at
256 px, rank 4, a state every 4 steps. The worker's config shows sd-scripts 4 repeats (12 batches: one epoch).
One image has no caption: sd-scripts captions it with the class tokens the config carries.

The run is SIGKILLed after its state of step 4 (a state main resumed too) and resumed; the resume is killed after
its own state of step 8 (which main refused) and resumed again; the last attempt ends `succeeded` with a verified
LoRA: `ss_steps` 10, the bars count 4 + 4 + 2, every step file named by its true step. Opt-in: run alone,
`flock /tmp/lw-rig.lock`, LW_RIG_DIR, >= 21 GB free; about 15-25 min on a loaded 2-core box. With
LW_RIG_CAPTURE_DIR set, the final LoRA's header is written there (tests/data/rig/final-lora-presented.header.json).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lora_worker.dispatch.presentation import presentation
from lora_worker.dispatch.resumable import presentation_of
from lora_worker.host.safetensors import read_header
from lora_worker.ledger import repository as repo
from tests.helpers.runs import wait_state, wait_states_removed
from tests.helpers.rig_worker import bar_steps, bar_totals, kill_after_state, log_of, report, resume, rig_worker, say

pytestmark = [pytest.mark.rig, pytest.mark.slow, pytest.mark.timeout(3600)]

RIG = os.environ.get("LW_RIG_DIR")
STEPS, EVERY = 10, 4


@pytest.fixture(scope="module")
def rig_host(tmp_path_factory: pytest.TempPathFactory):
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    sizes = {"max_train_steps": STEPS, "network_dim": 4, "resolution": 256, "save_every_n_steps": EVERY}
    with rig_worker(Path(RIG), tmp_path_factory.mktemp("rigepoch"), "rig2", "2_ohwx dog", sizes) as host:
        (Path(host[3]["dataset_dir"]) / "2_ohwx dog" / "img2.txt").unlink()  # captioned by the class tokens
        yield host


def test_states_past_the_folders_first_epoch_resume_right_and_the_run_trains_exactly_its_steps(rig_host) -> None:
    settings, client, db, body = rig_host
    say(f"sandbox={settings.sandbox}, tier fast = {settings.tiers['fast']}, a state every {EVERY} steps")
    answer = client.post("/train", json=body)
    assert answer.status_code == 202, answer.get_json()
    first = int(answer.get_json()["worker_job_id"])
    job = repo.get_job(db, first)
    shown, before = presentation_of(job), presentation(3, 1, STEPS, EVERY, folder_repeats=2)
    assert shown is not None and (shown.repeats, shown.steps_per_epoch, shown.epochs) == (4, 12, 1)
    assert [(s.step, s.resumable) for s in shown.states] == [(4, True), (8, True)]
    assert [(s.step, s.resumable) for s in before.states] == [(4, True), (8, False)]  # main's rule: 6 an epoch
    jobs = [first]
    try:
        kill_after_state(client, db, first, 4)
        second = resume(client, first, 4)
        jobs.append(second)
        kill_after_state(client, db, second, 8)
        output = Path(repo.get_job(db, second).output_dir)
        train_state = (output / "ohwx-step00000008-state" / "train_state.json").read_bytes()
        say(f"ohwx-step00000008-state/train_state.json: {train_state!r}")
        third = resume(client, second, 8)  # main: state_past_first_epoch
        jobs.append(third)
        done = wait_state(client, third, "succeeded", "failed", timeout=1800)
    finally:
        report(settings, client, db, jobs)
    assert train_state == b'{"current_epoch": 1, "current_step": 8}'
    assert done["status"] == "succeeded", done
    assert (done["step"], done["total_steps"], done["attempt"], done["resumed_from"]) == (STEPS, STEPS, 3, second)
    assert [bar_steps(settings, j) for j in jobs] == [4, 4, 2]  # 4 + 4 + 2 == max_train_steps
    assert [bar_totals(settings, j) for j in jobs] == [{10}, {6}, {2}]
    assert [[(c["step"], c["verified"]) for c in client.get(f"/train/{j}").get_json()["checkpoints"]]
            for j in jobs[:2]] == [[(4, True)], [(8, True)]]  # each step LoRA's ss_steps is the step in its name
    assert "skipping 4 steps" in log_of(settings, second) and "skipping 8 steps" in log_of(settings, third)
    assert "skipping epoch" not in log_of(settings, second) + log_of(settings, third)
    header = read_header(Path(done["lora_path"])).metadata
    if capture := os.environ.get("LW_RIG_CAPTURE_DIR"):
        Path(capture, "final-lora-presented.header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    say("final LoRA: " + ", ".join(f"{k}={header.get(k)}" for k in (
        "ss_steps", "ss_max_train_steps", "ss_epoch", "ss_num_epochs", "ss_num_train_images",
        "ss_num_batches_per_epoch", "ss_dataset_dirs", "ss_tag_frequency")))
    assert (header["ss_steps"], header["ss_max_train_steps"], header["ss_num_epochs"]) == ("10", "10", "1")
    assert json.loads(header["ss_dataset_dirs"]) == {"2_ohwx dog": {"n_repeats": 4, "img_count": 3}}
    assert header["ss_num_train_images"] == "12"
    # The two captions' tags, and the caption-less image captioned by the class tokens (img2's was a close-up)
    assert json.loads(header["ss_tag_frequency"]) == {"2_ohwx dog": {
        "ohwx dog": 3, "sitting on grass": 1, "running on a beach": 1}}
    wait_states_removed(Path(done["output_dir"]))

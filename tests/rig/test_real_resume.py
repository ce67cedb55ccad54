"""Issue 26 on the REAL trainer, through the worker: the API (Flask test client), the detached supervisor, the
sandbox, and sd-scripts from the CPU rig (LW_RIG_DIR, ../shared/rig). The `fast` tier is shrunk by the test's own
settings (`rig_tier_sizes`: 7 steps at 256 px, rank 4, a state every 2 steps; refused in a config file).

A run whose trainer group is SIGKILLed after its second state (step 4) is resumed through the API; the resume is
killed in turn after its own state (step 6) and resumed again; the last attempt ends `succeeded` with a verified
LoRA whose `ss_steps` is 7, and the three attempts' bars count 4 + 2 + 1 = 7 optimizer steps. A state truncated by
hand is refused with a reason. Opt-in: run alone, `flock /tmp/lw-rig.lock`, with >= 21 GB free; about 10-25 min.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lora_worker.host.safetensors import read_header
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from tests.helpers.rig_worker import bar_steps, bar_totals, kill_after_state, log_of, report, resume, rig_worker, say
from tests.helpers.runs import wait_state, wait_states_removed

pytestmark = [pytest.mark.rig, pytest.mark.slow, pytest.mark.timeout(3600)]

RIG = os.environ.get("LW_RIG_DIR")
STEPS, EVERY = 7, 2



@pytest.fixture(scope="module")
def rig_host(tmp_path_factory: pytest.TempPathFactory):
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    # 3 images x 3 repeats at batch 1: one epoch of 9 batches covers the 7 steps (sd-scripts-resume.md section 4).
    sizes = {"max_train_steps": STEPS, "network_dim": 4, "resolution": 256, "save_every_n_steps": EVERY}
    with rig_worker(Path(RIG), tmp_path_factory.mktemp("rigresume"), "rig1", "3_ohwx dog", sizes) as host:
        yield host


def truncated_state_is_refused(client, db: Database, job_id: int, step: int) -> None:
    """Cut the state's optimizer.bin to half, ask, then put the bytes back (the resume goes on from it)."""
    state = Path(repo.get_job(db, job_id).output_dir) / f"ohwx-step{step:08d}-state"
    optimizer, kept = state / "optimizer.bin", state.parent / "optimizer.bin.kept"
    shutil.copy2(optimizer, kept)
    os.truncate(optimizer, os.path.getsize(optimizer) // 2)
    verdict = client.get(f"/train/{job_id}/resume").get_json()
    answer = client.post(f"/train/{job_id}/resume")
    say(f"truncated {optimizer.name} to half: GET -> {verdict}; POST -> {answer.status_code} {answer.get_json()}")
    os.replace(kept, optimizer)
    assert not verdict["resumable"] and [r["code"] for r in verdict["reasons"]] == ["state_archive_corrupt"]
    assert answer.status_code == 422 and answer.get_json()["error"] == "not_resumable"


def test_killed_twice_and_resumed_twice_the_real_trainer_trains_exactly_max_train_steps(rig_host) -> None:
    settings, client, db, body = rig_host
    say(f"sandbox={settings.sandbox}, tier fast = {settings.tiers['fast']}, a state every "
        f"{settings.save_every_n_steps('fast')} steps")
    answer = client.post("/train", json=body)
    assert answer.status_code == 202, answer.get_json()
    first = int(answer.get_json()["worker_job_id"])
    jobs = [first]
    try:
        kill_after_state(client, db, first, 4)  # its second state: 2, then 4
        truncated_state_is_refused(client, db, first, 4)
        second = resume(client, first, 4)
        jobs.append(second)
        kill_after_state(client, db, second, 6)  # the resume's own first state
        third = resume(client, second, 6)
        jobs.append(third)
        done = wait_state(client, third, "succeeded", "failed", timeout=1800)
    finally:
        report(settings, client, db, jobs)
    assert done["status"] == "succeeded", done
    assert (done["step"], done["total_steps"], done["attempt"], done["resumed_from"]) == (STEPS, STEPS, 3, second)
    header = read_header(Path(done["lora_path"])).metadata
    say(f"final LoRA {done['lora_path']}: ss_steps={header['ss_steps']} ss_max_train_steps="
        f"{header['ss_max_train_steps']} ss_epoch={header['ss_epoch']}")
    assert (header["ss_steps"], header["ss_max_train_steps"]) == (str(STEPS), str(STEPS))
    assert [bar_steps(settings, j) for j in jobs] == [4, 2, 1]  # 4 + 2 + 1 == max_train_steps
    assert [bar_totals(settings, j) for j in jobs] == [{7}, {3}, {1}]  # a resume's bar counts the steps left
    # Each attempt's newest step LoRA, verified at its own step (ss_steps 4, 6) while the run was cut off.
    assert [[(c["step"], c["verified"]) for c in client.get(f"/train/{j}").get_json()["checkpoints"]]
            for j in jobs[:2]] == [[(4, True)], [(6, True)]]
    assert "skipping 4 steps" in log_of(settings, second) and "skipping 6 steps" in log_of(settings, third)
    wait_states_removed(Path(done["output_dir"]))

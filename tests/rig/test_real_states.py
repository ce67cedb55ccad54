"""The REAL trainer's step states and step LoRAs (docs/reference/sd-scripts-resume.md §1), on the CPU rig.

Opt-in: set LW_RIG_DIR to a rig built by ../shared/rig/build.sh; without it every test here skips (CI never builds
the rig). One run takes ~1.5 min and ~21 GB of RAM: run it alone, under `flock /tmp/lw-rig.lock`.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import real_trainer

pytestmark = [pytest.mark.rig, pytest.mark.slow, pytest.mark.timeout(900)]

RIG = os.environ.get("LW_RIG_DIR")
STATE_FILES = ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin", "train_state.json"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[real_trainer.Capture, Path]:
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    rig = Path(RIG)
    work = tmp_path_factory.mktemp("rig")
    dataset = work / "dataset" / "3_ohwx dog"
    shutil.copytree(rig / "data/img/2_ohwx dog", dataset)
    out = work / "out"
    cmd = real_trainer.argv(rig, dataset.parent, out, steps=6, extra=(
        "--save_state", "--save_every_n_steps=2", "--save_last_n_steps_state=1", "--save_last_n_steps=4"))
    return real_trainer.run(cmd, rig / "sd-scripts", real_trainer.env(work), out, timeout=600), out


def test_the_run_succeeds_and_keeps_one_step_state_the_last_state_and_the_step_loras_within_4_steps(
        finished: tuple[real_trainer.Capture, Path]) -> None:
    cap, out = finished
    assert cap.rc == 0 and "model saved.\n" in cap.text("stdout")
    assert sorted(p.name for p in out.iterdir()) == [
        "ohwx-state", "ohwx-step00000002.safetensors", "ohwx-step00000004.safetensors",
        "ohwx-step00000006-state", "ohwx-step00000006.safetensors", "ohwx.safetensors"]


def test_each_state_holds_the_five_files_with_intact_torch_zips(finished: tuple[real_trainer.Capture, Path]) -> None:
    _, out = finished
    for state in ("ohwx-step00000006-state", "ohwx-state"):
        rows = {r["name"]: r for r in real_trainer.listing(out / state)}
        assert sorted(rows) == STATE_FILES
        assert [n for n, r in rows.items() if r["is_zip"]] == ["optimizer.bin", "random_states_0.pkl", "scheduler.bin"]
        assert all(r["zip_intact"] for r in rows.values() if r["is_zip"])


def test_train_state_json_names_the_step_and_the_one_based_epoch(finished: tuple[real_trainer.Capture, Path]) -> None:
    _, out = finished
    assert (out / "ohwx-step00000006-state/train_state.json").read_bytes() == b'{"current_epoch": 1, "current_step": 6}'
    assert json.loads((out / "ohwx-state/train_state.json").read_bytes()) == {"current_epoch": 1, "current_step": 6}


def test_a_state_is_logged_then_the_older_one_removed(finished: tuple[real_trainer.Capture, Path]) -> None:
    cap, out = finished
    stdout = cap.text("stdout")
    for step in (2, 4, 6):
        assert f"\nsaving state at step {step}\n" in stdout
    save4 = stdout.index("saving state at step 4\n")
    removed = stdout.index(f"removing old state: {out}/ohwx-step00000002-state\n")
    assert save4 < removed < stdout.index("saving state at step 6\n")
    assert "saving last state.\n" in stdout


def test_the_state_model_is_the_lora_in_float32_without_ss_metadata(
        finished: tuple[real_trainer.Capture, Path]) -> None:
    _, out = finished
    state = real_trainer.safetensors_header(out / "ohwx-step00000006-state/model.safetensors")
    final = real_trainer.safetensors_header(out / "ohwx.safetensors")
    assert set(state) - {"__metadata__"} == set(final) - {"__metadata__"}
    assert {v["dtype"] for k, v in state.items() if k != "__metadata__"} == {"F32"}
    assert state["__metadata__"] == {"format": "pt"}
    assert final["__metadata__"]["ss_steps"] == "6"

"""The fake trainer's step checkpoints, states and resume, held to sd-scripts' source at the pinned commit
(train_network.py L930-970, L1232-1344, L1486-1509, L1722; library/train_util.py L5776-5994) and accelerate
1.6.0's save_state/load_state: the files, the lines, the pruning, and the step count of a resume, its bug
included."""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest

from lora_worker.host.safetensors import inspect_lora, read_header
from tests.helpers.fake_trainer import fake_rig, run

pytestmark = pytest.mark.slow

SAVES = ("--save_state", "--save_every_n_steps=2", "--save_last_n_steps=1", "--save_last_n_steps_state=1")


@pytest.fixture
def rig(tmp_path: Path) -> dict:
    return fake_rig(tmp_path)


def names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def metadata(path: Path) -> dict[str, str]:
    return read_header(path).metadata


def bar_totals(stderr: bytes) -> set[str]:
    return set(re.findall(r"steps:[^|]*\|[^|]*\| *\d+/(\d+)", stderr.decode()))


def test_states_and_step_loras_are_written_pruned_and_named_as_sd_scripts_does(rig):
    result = run(rig, *SAVES, steps=9)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    out = rig["out"]
    # one step LoRA and one step state kept (the newest), the end state, the final LoRA
    assert names(out) == ["ohwx-state", "ohwx-step00000008-state", "ohwx-step00000008.safetensors",
                          "ohwx.safetensors"]
    for state in ("ohwx-step00000008-state", "ohwx-state"):
        assert names(out / state) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin",
                                      "train_state.json"]
    assert json.loads((out / "ohwx-step00000008-state" / "train_state.json").read_text()) == {
        "current_epoch": 2, "current_step": 8}
    assert json.loads((out / "ohwx-state" / "train_state.json").read_text()) == {"current_epoch": 2, "current_step": 9}
    model = out / "ohwx-state" / "model.safetensors"
    assert inspect_lora(model).ranks == {4} and inspect_lora(model).dtypes.keys() == {"F32"}
    assert metadata(model) == {"format": "pt"}
    for name in ("optimizer", "scheduler", "random_states_0"):
        with zipfile.ZipFile(out / "ohwx-state" / f"{name}.{'pkl' if name.startswith('random') else 'bin'}") as z:
            assert z.testzip() is None
            assert {f"{name}/data.pkl", f"{name}/byteorder", f"{name}/version"} <= set(z.namelist())
            assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    step_lora = out / "ohwx-step00000008.safetensors"
    assert (metadata(step_lora)["ss_steps"], metadata(step_lora)["ss_epoch"]) == ("8", "1")  # the 0-based epoch
    assert metadata(out / "ohwx.safetensors")["ss_steps"] == "9"


def test_each_save_prints_what_sd_scripts_and_accelerate_print_in_that_order(rig):
    stdout = run(rig, *SAVES, steps=5).stdout.decode()
    out = rig["out"]
    first = stdout.index("saving checkpoint: ")
    second = stdout.index("saving checkpoint: ", first + 1)
    state2 = out / "ohwx-step00000002-state"
    assert stdout[first - 1:second].split("\n")[:12] == [
        "", f"saving checkpoint: {out}/ohwx-step00000002.safetensors", "", "saving state at step 2",
        f"Saving current state to {state2}", f"save train state to {state2}/train_state.json at epoch 1 step 2",
        f"Model weights saved in {state2}/model.safetensors", f"Optimizer state saved in {state2}/optimizer.bin",
        f"Scheduler state saved in {state2}/scheduler.bin",
        f"Sampler state for dataloader 0 saved in {state2}/sampler.bin",
        f"Sampler state for dataloader 1 saved in {state2}/sampler_1.bin",
        f"Random states saved in {state2}/random_states_0.pkl"]
    after_second = stdout[second:stdout.index("saving checkpoint: ", second + 1)]
    assert f"removing old state: {state2}\nremoving old checkpoint: {out}/ohwx-step00000002.safetensors\n" \
        in after_second
    assert stdout.index("saving last state.") < stdout.index(f"saving checkpoint: {out}/ohwx.safetensors")


def test_a_save_at_the_last_step_is_made_as_sd_scripts_makes_it(rig):
    assert run(rig, *SAVES, steps=4).returncode == 0
    assert names(rig["out"]) == ["ohwx-state", "ohwx-step00000004-state", "ohwx-step00000004.safetensors",
                                 "ohwx.safetensors"]


def test_a_resume_within_the_first_epoch_counts_on_from_the_state(rig):
    assert run(rig, *SAVES, steps=5, crash_at_step=5).returncode == 1
    state = rig["out"] / "ohwx-step00000004-state"
    result = run(rig, *SAVES, "--skip_until_initial_step", f"--resume={state}", steps=5)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    stdout = result.stdout.decode()
    assert f"resume training from local state: {state}" in stdout
    assert f"load train state from {state}/train_state.json: {{'current_epoch': 1, 'current_step': 4}}" in stdout
    assert bar_totals(result.stderr) == {"1"}  # 5 - 4 steps left
    assert metadata(rig["out"] / "ohwx.safetensors")["ss_steps"] == "5"


def test_a_resume_past_the_first_epoch_miscounts_as_the_real_trainer_does(rig):
    """train_network.py L1340-1344: global_step restarts at the steps into the epoch (8 - 6 = 2), so the run
    trains on to the end of its epochs (4 more steps, 12 in all of 9), names its saves by the wrong step (4, 6:
    the names of older saves) and writes ss_steps 6."""
    assert run(rig, *SAVES, steps=9, crash_at_step=9).returncode == 1
    state = rig["out"] / "ohwx-step00000008-state"
    result = run(rig, *SAVES, "--skip_until_initial_step", f"--resume={state}", steps=9)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    stdout = result.stdout.decode()
    assert "skipping 8 steps" in stdout and "skipping epoch 1 because initial_step (multiplied) is 8" in stdout
    assert bar_totals(result.stderr) == {"7"}
    assert re.findall(r"saving checkpoint: \S+-step(\d+)\.safetensors", stdout) == ["00000004", "00000006"]
    assert metadata(rig["out"] / "ohwx.safetensors")["ss_steps"] == "6"


def test_a_resume_without_skipping_counts_from_zero(rig):
    assert run(rig, *SAVES, steps=9, crash_at_step=9).returncode == 1
    result = run(rig, *SAVES, f"--resume={rig['out'] / 'ohwx-step00000008-state'}", steps=9)
    assert result.returncode == 0
    assert "ステップをスキップします" not in result.stdout.decode() and bar_totals(result.stderr) == {"9"}
    assert metadata(rig["out"] / "ohwx.safetensors")["ss_steps"] == "6"  # epoch 2 alone: 6 steps from 0


def test_a_resume_from_the_end_state_or_a_broken_one_fails_as_sd_scripts_does(rig):
    assert run(rig, *SAVES, steps=5).returncode == 0
    end = run(rig, *SAVES, "--skip_until_initial_step", f"--resume={rig['out'] / 'ohwx-state'}", steps=5)
    assert end.returncode == 1 and b"AssertionError: max_train_steps should be greater than initial step" in end.stderr
    broken = rig["out"] / "ohwx-step00000004-state"
    (broken / "optimizer.bin").unlink()
    missing = run(rig, *SAVES, "--skip_until_initial_step", f"--resume={broken}", steps=5)
    assert missing.returncode == 1 and b"FileNotFoundError" in missing.stderr

"""The fake trainer's states, step LoRAs and resumes held to the real trainer's (tests/data/rig, the CPU rig's runs
R1, R2, R6, R7 of docs/reference/sd-scripts-resume.md), as tests/test_fakes.py holds its plain runs to
tests/data/*.jsonl: the fake is run with each capture's argv (at a test's pace) and what the worker reads from
it must be what the real trainer wrote. Compared: the output lines, in order, byte for byte but for the output
dir and the bar's times (the `steps` redraws by their counts); the files' names, formats and metadata. The
tensors are the real ones' names, shapes and dtypes; their data is sparse zeros, and the torch zips hold a few
bytes of data records instead of the real megabytes (`data_records` is not compared, only that there are some)."""
from __future__ import annotations

import json
import re
import struct
import zipfile
from pathlib import Path

import pytest

from lora_worker.host.safetensors import read_header
from lora_worker.host.train_state import check_state
from tests.helpers import SDXL_TINY, install_fake_trainer, make_dataset, write_safetensors
from lora_worker.host.images import png_size
from tests.helpers.rig_captures import RIG, around, events, flag, meta, run_fake, stream
from tests.rig import capture_samples

pytestmark = pytest.mark.slow

R1, R2, R6, R7 = ("states_killed_after_step4", "resume_skip_from_step4", "resume_skip_past_epoch1",
                  "resume_truncated_optimizer")
STATE_FILES = ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin", "train_state.json"]


@pytest.fixture
def rig(tmp_path: Path) -> dict:
    install = install_fake_trainer(tmp_path / "opt")
    model = tmp_path / "models" / "sdxl_random.safetensors"
    write_safetensors(model, SDXL_TINY)
    dataset = make_dataset(tmp_path / "train", "t1", "3_ohwx dog", images=3)  # R1's: 9 batches an epoch
    return {**install, "model": model, "dataset": dataset, "out": tmp_path / "train" / "t1" / "output" / "r1"}


@pytest.fixture
def killed_at_4(rig) -> dict:
    """R1 on the fake: states at 2 and 4, then the run dies in step 5 (R1 was SIGKILLed after step 4's save)."""
    result = run_fake(R1, rig, merged=True, crash_at_step=5)
    assert result.returncode == 1
    return {**rig, "r1": result}


def real_events(name: str) -> list[str]:
    return events(stream(name), flag(meta(name)["argv"], "output_dir"))


def fake_events(result, rig: dict) -> list[str]:
    # the fake is the GPU box's double; the rig's trainer ran on the CPU (the one line that names the device)
    return [e.replace("device: cuda:0", "device: cpu") for e in events(result.stdout, str(rig["out"]))]


def metadata_of(path: Path) -> dict[str, str]:
    return read_header(path).metadata


def raw_header(path: Path) -> dict:
    with path.open("rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header: dict = json.loads(fh.read(n))
    return header


def assert_tensors_as_real(path: Path, real_name: str) -> None:
    real, fake = json.loads((RIG / real_name).read_text()), raw_header(path)
    assert {k: (v["dtype"], v["shape"]) for k, v in fake.items() if k != "__metadata__"} == {
        k: (v["dtype"], v["shape"]) for k, v in real.items() if k != "__metadata__"}
    assert fake["__metadata__"].keys() == real["__metadata__"].keys()


def test_a_step_save_and_a_state_save_print_what_the_real_trainer_printed_between_the_steps_two_redraws(killed_at_4):
    """R1 at steps 2 and 4: the step LoRA's line, the state's lines (accelerate's INFO lines among them, plain
    under --console_log_simple), the older state's removal, all between the update redraw and the postfix one."""
    real, fake = real_events(R1), fake_events(killed_at_4["r1"], killed_at_4)
    for step in (2, 4):
        first, second = f"bar {step}/8+loss", f"bar {step}/8+loss"
        assert around(fake, first, second) == around(real, first, second)
    assert around(fake, "bar 0/8", "bar 4/8+loss") == around(real, "bar 0/8", "bar 4/8+loss")
    assert "removing old state: <out>/ohwx-step00000002-state" in around(real, "bar 4/8+loss", "bar 4/8+loss")


def test_redraws_are_on_stderr_and_the_save_lines_on_stdout_as_in_the_real_run(rig):
    result = run_fake(R1, rig, crash_at_step=5)
    for out, err in ((result.stdout, result.stderr), (stream(R1, "stdout"), stream(R1, "stderr"))):
        assert b"\rsteps:" in err and b"\rsteps:" not in out
        assert b"saving state at step 4\n" in out and b"saving state" not in err
        assert b"Model weights saved in " in out and b"removing old state: " in out


def test_a_state_holds_the_real_states_files_in_their_formats(killed_at_4):
    state = killed_at_4["out"] / "ohwx-step00000004-state"
    real = json.loads((RIG / "state-step4.listing.json").read_text())
    assert sorted(p.name for p in state.iterdir()) == [f["name"] for f in real] == STATE_FILES
    for row in real:
        assert zipfile.is_zipfile(state / row["name"]) is row["is_zip"], row["name"]
    assert (state / "train_state.json").read_bytes() == (RIG / "state-step4.train_state.json").read_bytes() == (
        b'{"current_epoch": 1, "current_step": 4}')
    assert_tensors_as_real(state / "model.safetensors", "state-step4-model.header.json")
    assert metadata_of(state / "model.safetensors") == {"format": "pt"}
    assert check_state(str(killed_at_4["out"]), state.name, rank=4).problems == []  # the worker's own check


def test_the_states_torch_zips_are_laid_out_as_torch_save_lays_them_out(killed_at_4):
    """The records of R6's real step-2 state (tests/data/rig/state-step2-past-epoch1.zip-records.json)."""
    state = killed_at_4["out"] / "ohwx-step00000004-state"
    for name, real in json.loads((RIG / "state-step2-past-epoch1.zip-records.json").read_text()).items():
        raw = (state / name).read_bytes()
        with zipfile.ZipFile(state / name) as archive:
            infos = archive.infolist()
            records = [i.filename for i in infos if "/data/" not in i.filename]
            data = [i.filename for i in infos if "/data/" in i.filename]
            assert records == real["records"], name
            assert bool(data) == bool(real["data_records"]) and (data[:1] or [None])[0] == real["first_data_record"]
            assert sorted({i.compress_type for i in infos}) == real["compress_types"]
            assert {i.filename: archive.read(i).decode() for i in infos if i.filename in real["text_records"]} == (
                real["text_records"])
        starts = {(i.header_offset + 30 + sum(struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])))
                  % 64 for i in infos}
        assert sorted(starts) == real["data_offsets_mod_64"], name


def test_a_step_lora_is_the_real_step_loras_shape(killed_at_4):
    lora = killed_at_4["out"] / "ohwx-step00000004.safetensors"
    assert_tensors_as_real(lora, "step-lora-step4.header.json")
    real = json.loads((RIG / "step-lora-step4.header.json").read_text())["__metadata__"]
    md = metadata_of(lora)
    for key in ("ss_steps", "ss_epoch", "ss_max_train_steps", "ss_num_epochs", "ss_num_batches_per_epoch",
                "ss_num_train_images", "ss_dataset_dirs", "ss_network_dim", "ss_output_name", "ss_mixed_precision"):
        assert md[key] == real[key], key


def test_a_resume_prints_and_counts_what_the_real_resume_did(killed_at_4):
    """R2: the load lines (`Could not load random states`, as on the rig), `skipping 4 steps`, the bar from `0/4`,
    states 6 and 8 (the one resumed from removed at 6), the end state, the final LoRA."""
    rig = killed_at_4
    result = run_fake(R2, rig, merged=True)
    assert result.returncode == 0
    start = "prepare optimizer, data loader etc."
    real, fake = real_events(R2), fake_events(result, rig)
    assert fake[fake.index(start):] == real[real.index(start):]
    out = rig["out"]
    assert sorted(p.name for p in out.iterdir()) == [
        "ohwx-state", "ohwx-step00000004.safetensors", "ohwx-step00000006.safetensors", "ohwx-step00000008-state",
        "ohwx-step00000008.safetensors", "ohwx.safetensors"]
    for state, capture in (("ohwx-step00000008-state", "state-step8-resumed"), ("ohwx-state", "state-last-resumed")):
        assert (out / state / "train_state.json").read_bytes() == (RIG / f"{capture}.train_state.json").read_bytes()
        assert sorted(p.name for p in (out / state).iterdir()) == [
            f["name"] for f in json.loads((RIG / f"{capture}.listing.json").read_text())]
    real_md = json.loads((RIG / "final-lora-resumed.header.json").read_text())["__metadata__"]
    md = metadata_of(out / "ohwx.safetensors")
    assert [md[k] for k in ("ss_steps", "ss_epoch", "ss_max_train_steps")] == [
        real_md[k] for k in ("ss_steps", "ss_epoch", "ss_max_train_steps")] == ["8", "1", "8"]


def test_a_resume_past_epoch_1_miscounts_and_misnames_as_the_real_one_did(killed_at_4, tmp_path):
    """R6: the step-4 state over 1 repeat (3 batches an epoch, 5 steps): `skipping epoch 1 …`, the bar `0/4` that
    stops at `2/4`, the state of real step 5 named step 2, `ss_steps` 3."""
    rig = {**killed_at_4, "dataset": make_dataset(tmp_path / "train", "t2", "1_ohwx dog", images=3)}
    result = run_fake(R6, rig, merged=True)
    assert result.returncode == 0
    start = "prepare optimizer, data loader etc."
    real, fake = real_events(R6), fake_events(result, rig)
    assert fake[fake.index(start):] == real[real.index(start):]
    assert "skipping epoch 1 because initial_step (multiplied) is 4" in fake
    out = rig["out"]
    assert (out / "ohwx-step00000002-state" / "train_state.json").read_bytes() == (
        RIG / "state-step2-past-epoch1.train_state.json").read_bytes() == b'{"current_epoch": 2, "current_step": 2}'
    assert (out / "ohwx-step00000004-state").is_dir()  # the real step 4's: not removed (r = 0)
    real_md = json.loads((RIG / "final-lora-past-epoch1.header.json").read_text())["__metadata__"]
    md = metadata_of(out / "ohwx.safetensors")
    assert [md[k] for k in ("ss_steps", "ss_epoch", "ss_max_train_steps")] == [
        real_md[k] for k in ("ss_steps", "ss_epoch", "ss_max_train_steps")] == ["3", "2", "5"]


def test_a_truncated_optimizer_fails_the_resume_as_the_real_trainer_failed(killed_at_4):
    """R7: optimizer.bin cut to half; torch's reader raises after the model weights loaded; the trainer exits 1,
    the launcher raises CalledProcessError and exits 1; nothing is written."""
    rig = killed_at_4
    optimizer = rig["out"] / "ohwx-step00000004-state" / "optimizer.bin"
    with optimizer.open("r+b") as fh:
        fh.truncate(optimizer.stat().st_size // 2)
    before = sorted(p.name for p in rig["out"].iterdir())
    result = run_fake(R7, rig, merged=True)
    assert result.returncode == meta(R7)["rc"] == 1
    real, fake = real_events(R7), fake_events(result, rig)
    for found in (real, fake):
        loaded = found.index("All model weights loaded successfully")
        assert found[loaded + 1] == "Traceback (most recent call last):"
        [exception] = [e for e in found if e.startswith("RuntimeError: ")]
        assert found.index(exception) > loaded
        assert exception == ("RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central "
                             "directory. This is an internal miniz error. If you are seeing this error, there is a "
                             "high likelihood that your checkpoint file is corrupted. This can happen if the "
                             "checkpoint was not saved properly, was transferred incorrectly, or the file was "
                             "modified after saving.")
        assert found[-2].startswith("subprocess.CalledProcessError: Command '[")
        assert found[-2].endswith("]' returned non-zero exit status 1.")
    functions = {line.rsplit(" in ", 1)[1] for line in fake if line.startswith("  File ")}
    assert {"resume_from_local_or_hf_if_specified", "load_state", "load_accelerator_state"} <= functions
    assert sorted(p.name for p in rig["out"].iterdir()) == before


def test_a_broken_random_states_file_is_swallowed_as_accelerate_swallows_it(killed_at_4):
    """accelerate 1.6 checkpointing.py L276-297: any failure there is `Could not load random states`, and the
    run goes on (the worker checks that file itself)."""
    rig = killed_at_4
    states = rig["out"] / "ohwx-step00000004-state" / "random_states_0.pkl"
    states.write_bytes(states.read_bytes()[:100])
    result = run_fake(R2, rig, merged=True, step_s=0.005)
    assert result.returncode == 0 and b"Could not load random states\n" in result.stdout


def test_a_state_without_train_state_json_trains_from_step_0(killed_at_4):
    """train_network.py L963-969: without the file steps_from_state stays None; nothing is skipped (from
    source: the rig did not run it)."""
    rig = killed_at_4
    (rig["out"] / "ohwx-step00000004-state" / "train_state.json").unlink()
    result = run_fake(R2, rig, merged=True, step_s=0.005)
    assert result.returncode == 0
    found = fake_events(result, rig)
    assert "bar 0/8" in found and not any(e.startswith("skipping ") for e in found)
    assert metadata_of(rig["out"] / "ohwx.safetensors")["ss_steps"] == "8"



# -- sample passes (issue 33): S1, the rig's run with two prompts at 256 px, 4 sampler steps, every 2 steps ----------

S1 = "samples_run"
NAME = re.compile(r"^ohwx_(e000000|\d{6})_(\d{2})_\d{14}_(\d+)\.png$")


@pytest.fixture
def sampled(rig) -> dict:
    """S1 on the fake: its argv, its prompts file (tests/rig/capture_samples.py wrote the real one)."""
    prompts = rig["out"].parent / "prompts.json"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text(json.dumps(capture_samples.PROMPTS))
    rig = {**rig, "prompts": prompts}
    result = run_fake(S1, rig, merged=True, sample_step_s=0.2)
    assert result.returncode == meta(S1)["rc"] == 0
    return {**rig, "s1": result}


def lines(found: list[str]) -> list[str]:
    """The log lines: no blank one, none of the sampler's unnamed bar, no torch warning (the rig's CPU run warns
    that the checkpointed U-Net gets no gradient in a pass, where a GPU run's output varies)."""
    return [e for e in found if e.strip() and not e.startswith("\x1b") and "UserWarning" not in e
            and "check_backward_validity" not in e]


def test_a_pass_prints_what_the_real_trainers_did_between_the_steps_update_and_its_save(sampled):
    """At steps 2, 4 and 6: the update redraw, the pass's lines for each prompt, then the step LoRA's save line;
    before the first step, the pass at step 0 between the preamble and the `unet dtype` line."""
    real, fake = lines(real_events(S1)), lines(fake_events(sampled["s1"], sampled))
    for step in (2, 4, 6):
        first, last = f"bar {step}/6+loss", f"saving checkpoint: <out>/ohwx-step{step:08d}.safetensors"
        assert around(fake, first, last) == around(real, first, last)
        assert around(real, first, last)[1] == f"generating sample images at step / サンプル画像生成 ステップ: {step}"
    first = "generating sample images at step / サンプル画像生成 ステップ: 0"
    assert around(fake, first, "bar 0/6") == around(real, first, "bar 0/6")
    assert [e for e in real if e.startswith("generating sample")] == [e for e in fake if e.startswith("generating")]


def test_the_samplers_bar_is_unnamed_and_never_the_steps_bar(sampled):
    """A pass draws tqdm's bar without a `steps:` label (leave=False); inside the loop at position 1, a newline
    first and a cursor-up after each redraw, as the real one: the worker's `steps:` anchor never reads it."""
    for data in (stream(S1), sampled["s1"].stdout):  # both streams, as the one pipe gives them
        at = data.index("サンプル画像生成 ステップ: 2".encode())
        between = data[at:data.index(b"saving checkpoint", at)]
        assert b"\rsteps:" not in between and b"| 4/4 [" in between
        assert b"\n\r  0%|          | 0/4 [" in between and b"\x1b[A" in between


def test_the_images_are_named_sized_and_laid_out_as_the_real_ones(sampled):
    real = json.loads((RIG / "samples_listing.json").read_text())
    fake = sorted((sampled["out"] / "sample").iterdir())
    assert sorted(NAME.sub(r"\1 \2 \3", p.name) for p in fake) == sorted(
        NAME.sub(r"\1 \2 \3", r["name"]) for r in real["sample"])  # step, prompt and seed: the time is the run's
    assert all(NAME.match(p.name) for p in fake)
    for path in fake + [RIG / "sample-step4-prompt0.png"]:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        assert struct.unpack(">IIBB", data[16:26]) == (256, 256, 8, 2)  # 8-bit RGB, as Pillow saves sd-scripts'
        assert png_size(data) == (256, 256)  # decoded whole by the worker's own check


def test_the_last_steps_step_lora_holds_the_final_weights_on_the_real_trainer():
    """Why the intervals divide the steps (config_tables.SAVE_EVERY_N_STEPS): the pass at the last step draws the
    final weights, and its step LoRA's tensors are the final LoRA's byte for byte (only the headers differ)."""
    real = json.loads((RIG / "samples_listing.json").read_text())["lora_tensor_sha256"]
    assert real["ohwx-step00000006.safetensors"] == real["ohwx.safetensors"]
    assert len({real[f"ohwx-step{s:08d}.safetensors"] for s in (2, 4, 6)}) == 3  # each step's weights its own

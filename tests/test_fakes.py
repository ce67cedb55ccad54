"""The fake trainer and launcher are doubles of real programs: held to the real captures and documented facts."""
from __future__ import annotations

import ast
import base64
import importlib.util
import json
import os
import re
import signal
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from lora_worker.host.safetensors import inspect_lora, read_header
from lora_worker.states import Phase
from tests.helpers import (DATA, SDXL_TINY, pid_alive, set_modes, wait_for,
                           write_safetensors, write_tokenizer)
from tests.helpers.fake_trainer import ENV, argv, fake_rig, run


@pytest.fixture
def rig(tmp_path: Path) -> dict:
    return fake_rig(tmp_path)


def capture(name: str, stream: str) -> bytes:
    lines = (DATA / f"{name}.jsonl").read_text().splitlines()[1:]
    return b"".join(base64.b64decode(c["b64"]) for c in map(json.loads, lines) if c["stream"] == stream)


def shape(text: str) -> list[str]:
    """A line with its run-specific parts (paths, numbers, device, optimizer) blanked out."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"/\S*(?: dog)?", "<path>", line)
        line = re.sub(r"\d+(\.\d+)?", "<n>", line)
        line = line.replace("cuda:<n>", "cpu").replace("cuda", "cpu").replace("torch.bfloat<n>", "torch.float<n>")
        out.append(line)
    return out


@pytest.mark.slow
def test_stdout_has_the_lines_of_the_real_run_in_the_same_order(rig):
    result = run(rig)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert shape(result.stdout.decode()) == shape(capture("run1_simple", "stdout").decode())


@pytest.mark.slow
def test_the_steps_bar_is_redrawn_like_tqdm_in_the_real_run(rig):
    result = run(rig, step_s=0.2)  # slower than tqdm's 0.1 s minimum interval, as real steps are
    redraws = [r for r in result.stderr.decode().split("\r") if r.startswith("steps:")]
    real = [r for r in capture("run1_simple", "stderr").decode().split("\r") if r.startswith("steps:")]
    pattern = re.compile(r"steps: +\d+%\|[^|]*\| \d+/\d+ \[[\d:]+<[\d:?]+, +[\d.?]+(it/s|s/it)"
                         r"(, avr_loss=[\d.]+)?\] *\n?$")
    assert all(pattern.match(r) for r in redraws + real)
    fake_n = [re.search(r"\| (\d+)/", r)[1] for r in redraws]  # type: ignore[index]
    real_n = [re.search(r"\| (\d+)/", r)[1] for r in real]  # type: ignore[index]
    assert fake_n == real_n == ["0", "1", "1", "2", "2", "3", "3", "3"]
    assert "avr_loss" not in redraws[1] and "avr_loss" in redraws[2]  # step 1's first redraw has no loss yet
    assert redraws[-1].endswith("\n") and not redraws[-2].endswith("\n")  # closed after "model saved."


@pytest.mark.slow
def test_the_lora_is_a_real_safetensors_file_of_the_requested_rank(rig):
    from safetensors.numpy import load_file  # the reference reader, not ours

    assert run(rig, "--network_dim=8", "--network_alpha=8", steps=3).returncode == 0
    path = rig["out"] / "ohwx.safetensors"
    tensors = load_file(str(path))
    real = json.loads((DATA / "lora-header-run1_simple.json").read_text())
    assert set(tensors) == set(real["tensors"])
    name = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    assert tensors[f"{name}.lora_down.weight"].shape == (8, 640)
    assert tensors[f"{name}.lora_up.weight"].shape == (640, 8) and float(tensors[f"{name}.alpha"]) == 8.0
    header = read_header(path)
    assert set(header.metadata) == set(real["__metadata__"])
    md = header.metadata
    assert (md["ss_network_dim"], md["ss_output_name"], md["ss_seed"], md["ss_max_train_steps"]) == (
        "8", "ohwx", "42", "3")
    assert inspect_lora(path).ranks == {8}


@pytest.mark.slow
def test_an_empty_train_data_dir_prints_what_the_capture_shows_and_exits_0_without_a_file(rig):
    shutil.rmtree(rig["dataset"] / "2_ohwx dog")  # the capture's case: train_data_dir holds nothing
    result = run(rig, bnb_warning=True)  # as on the capture box
    assert result.returncode == 0 and not rig["out"].exists()
    assert shape(result.stdout.decode()) == shape(capture("fail_empty_dataset", "stdout").decode())
    assert shape(result.stderr.decode()) == shape(capture("fail_empty_dataset", "stderr").decode())


@pytest.mark.slow
def test_an_empty_subset_is_ignored_as_train_util_does_then_no_images_exits_0(rig):
    for f in (rig["dataset"] / "2_ohwx dog").iterdir():
        f.unlink()
    result = run(rig)
    assert result.returncode == 0 and not rig["out"].exists()
    out = shape(result.stdout.decode())
    [ignored] = shape(f"ignore subset with image_dir='{rig['dataset']}/2_ohwx dog': no images found / "
                      "画像が見つからないためサブセットを無視します")
    assert out.index("found directory <path> contains <n> image files") < out.index(ignored)
    assert b"model saved." not in result.stdout
    assert out[-3:] == shape(capture("fail_empty_dataset", "stdout").decode())[-3:]


@pytest.mark.slow
def test_unknown_flags_exit_2_inside_and_1_outside(rig):
    result = run(rig, "--text_encoder_lr1=1e-5")
    assert result.returncode == 1
    err = result.stderr.decode()
    assert "sdxl_train_network.py: error: unrecognized arguments: --text_encoder_lr1=1e-5" in err
    assert "returned non-zero exit status 2." in err


@pytest.mark.slow
def test_a_missing_model_fails_like_diffusers_does(rig):
    rig["model"].unlink()
    result = run(rig)
    assert result.returncode == 1
    assert b"is neither a valid local path nor a valid repo id" in result.stderr
    assert b"load Diffusers pretrained models:" in result.stdout
    assert b"returned non-zero exit status 1." in capture("fail_missing_model", "stderr")
    assert b"returned non-zero exit status 1." in result.stderr


@pytest.mark.slow
def test_an_empty_caption_crashes_like_sd_scripts(rig):
    (rig["dataset"] / "2_ohwx dog" / "img1.txt").write_bytes(b"")
    result = run(rig)
    assert result.returncode == 1
    assert b"AssertionError: caption file is empty" in result.stderr
    assert b"AssertionError: caption file is empty" in capture("fail_empty_caption", "stderr")


@pytest.mark.slow
def test_cuda_oom_reads_like_torch(rig):
    result = run(rig, oom_at_step=2)
    assert result.returncode == 1
    assert b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in result.stderr


@pytest.mark.slow
def test_the_launcher_forwards_no_signal_and_the_trainer_is_orphaned(rig, tmp_path):
    record = tmp_path / "record.json"
    set_modes(rig["sd_scripts_dir"], hang_in="training", record=str(record))
    launcher = subprocess.Popen(argv(rig), cwd=rig["sd_scripts_dir"], env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    trainer = wait_for(lambda: record.exists() and json.loads(record.read_text()), what="trainer start")
    assert trainer["pgid"] == launcher.pid  # two levels, one process group: accelerate → trainer
    os.kill(launcher.pid, signal.SIGTERM)
    assert launcher.wait(5) == -signal.SIGTERM
    time.sleep(0.3)
    assert pid_alive(trainer["pid"])  # still training, re-parented
    os.killpg(launcher.pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(trainer["pid"]), what="trainer gone")


@pytest.mark.slow
def test_modes_reach_the_fake_through_a_file_not_the_environment(rig, tmp_path):
    record = tmp_path / "record.json"
    assert run(rig, record=str(record)).returncode == 0
    seen = json.loads(record.read_text())
    assert {k: seen["env"][k] for k in ENV} == ENV  # the launcher passed the environment through
    assert seen["env"]["OMP_NUM_THREADS"] == "2"
    assert seen["argv"][0].endswith("sdxl_train_network.py")


# -- the two real failures the preflight now refuses: the fake still reproduces them -----------------------------

def real_argv(log_name: str, rig: dict, **paths: Path) -> list[str]:
    """The worker's argv from the run log's launcher line, pointed at the rig (and at `paths` overrides)."""
    last = (DATA / log_name).read_text().rstrip("\n").rsplit("\n", 1)[-1]
    cmd = ast.literal_eval(re.match(r"subprocess\.CalledProcessError: Command '(\[.*\])' returned", last)[1])
    where = {"pretrained_model_name_or_path": rig["model"], "tokenizer_cache_dir": rig["tokenizer_cache_dir"],
             "train_data_dir": rig["dataset"], "output_dir": rig["out"], **paths}
    args = [re.sub(r"^--(\w+)=.*$", lambda m: f"--{m[1]}={where[m[1]]}" if m[1] in where else m[0], a)
            for a in cmd[2:]]
    return argv(rig)[:13] + args  # the rig's launcher and script, then the real run's trainer arguments


def merged_lines(result: subprocess.CompletedProcess[bytes]) -> list[str]:
    """One pipe's output as the worker's run log keeps it: each line's last redraw, no blank lines."""
    lines = (line.rsplit("\r", 1)[-1].rstrip() for line in result.stdout.decode().split("\n"))
    return [line for line in lines if line.strip()]


def log_lines(name: str) -> list[str]:
    return [line.rstrip() for line in (DATA / name).read_text().split("\n") if line.strip()]


def up_to_the_traceback(lines: list[str]) -> list[str]:
    """The lines before the trainer's traceback, blanked as `shape` does; a bar's padding is not compared."""
    return [re.sub(" +", " ", line) for line in shape("\n".join(lines[:lines.index(
        "Traceback (most recent call last):")]))]


def launcher_line(line: str) -> str:
    return re.sub(r"Command '\[.*\]'", "Command '[…]'", line)


def run_merged(rig: dict, args: list[str], **modes: object) -> subprocess.CompletedProcess[bytes]:
    set_modes(rig["sd_scripts_dir"], **modes)
    return subprocess.run(args, cwd=rig["sd_scripts_dir"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=60, start_new_session=True)


@pytest.mark.slow
def test_a_model_missing_keys_dies_loading_the_unet_as_in_the_real_run_log(rig):
    real = log_lines("fail_model_missing_keys.log")
    missing_line = next(line for line in real if line.startswith("\tMissing key(s) in state_dict: "))
    real_missing = set(re.findall(r'"([^"]+)"', missing_line))
    prefix = "model.diffusion_model."
    unet = {k[len(prefix):]: v for k, v in SDXL_TINY.items() if k.startswith(prefix)}
    [kept] = set(unet) - real_missing  # the real file held one U-Net key, and one of each other family
    others = [next(k for k in SDXL_TINY if k.startswith(p)) for p in
              ("conditioner.embedders.0.", "conditioner.embedders.1.", "first_stage_model.")]
    write_safetensors(rig["model"], {prefix + kept: SDXL_TINY[prefix + kept], **{k: SDXL_TINY[k] for k in others}})
    result = run_merged(rig, real_argv("fail_model_missing_keys.log", rig), bnb_warning=True)
    assert result.returncode == 1
    fake = merged_lines(result)
    assert up_to_the_traceback(fake) == up_to_the_traceback(real)  # ends "loading U-Net from checkpoint"
    at = fake.index("RuntimeError: Error(s) in loading state_dict for SdxlUNet2DConditionModel:")
    assert fake[at + 1].startswith("\tMissing key(s) in state_dict: ")
    assert set(re.findall(r'"([^"]+)"', fake[at + 1])) == real_missing
    assert launcher_line(fake[-1]) == launcher_line(real[-1]) == (
        "subprocess.CalledProcessError: Command '[…]' returned non-zero exit status 1.")


@pytest.mark.slow
def test_hollow_tokenizers_die_caching_text_encoder_outputs_as_in_the_real_run_log(rig, tmp_path):
    hollow = tmp_path / "tokenizers-hollow"
    for name in ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k"):
        write_tokenizer(hollow / name, vocab_json=b"{}", merges_txt=b"", tokenizer_config_json=None)
    result = run_merged(rig, real_argv("fail_tokenizer_hollow.log", rig, tokenizer_cache_dir=hollow),
                        bnb_warning=True)
    assert result.returncode == 1
    fake, real = merged_lines(result), log_lines("fail_tokenizer_hollow.log")
    assert up_to_the_traceback(fake) == up_to_the_traceback(real)
    error = "OverflowError: cannot fit 'int' into an index-sized integer"
    assert error in fake and error in real
    assert launcher_line(fake[-1]) == launcher_line(real[-1])
    assert not (rig["out"] / "ohwx_d2.safetensors").exists()


@pytest.mark.slow
def test_real_tokenizers_without_their_config_fail_the_same_way(rig):
    # the fixture README: real vocab.json and merges.txt without tokenizer_config.json (max_length 10^30)
    (rig["tokenizer_cache_dir"] / "openai_clip-vit-large-patch14" / "tokenizer_config.json").unlink()
    result = run_merged(rig, argv(rig))
    assert result.returncode == 1
    assert "OverflowError: cannot fit 'int' into an index-sized integer" in merged_lines(result)


def test_the_fake_runs_one_function_per_phase():
    spec = importlib.util.spec_from_file_location("fake_trainer", Path(__file__).parent / "fakes" /
                                                  "sdxl_train_network.py")
    assert spec is not None and spec.loader is not None
    source = Path(spec.origin or "").read_text()
    tree = ast.parse(source)
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    called = [n.func.id for n in ast.walk(train) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    # but `sampling`: sd-scripts enters a pass from the training loop (before the first step, before each step
    # save), as the fake's `training` does (tests/fakes/sd_samples.py)
    phases = [p.value for p in Phase if p is not Phase.SAMPLING]
    assert [name for name in called if name in phases] == phases
    training = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "training")
    assert "sample_images" in {n.func.id for n in ast.walk(training) if isinstance(n, ast.Call)
                               and isinstance(n.func, ast.Name)}


@pytest.mark.parametrize("break_it, failure", [
    (lambda rig: write_safetensors(rig["model"], {"model.diffusion_model.x": ("F16", [1])}), "model_load_error"),
    (lambda rig: rig["model"].unlink(), "model_load_error"),
    (lambda rig: (rig["tokenizer_cache_dir"] / "openai_clip-vit-large-patch14" / "tokenizer_config.json").unlink(),
     "tokenizer_invalid"),
    (lambda rig: shutil.rmtree(rig["tokenizer_cache_dir"]), "tokenizer_missing"),
    (lambda rig: (rig["dataset"] / "2_ohwx dog" / "img1.txt").write_bytes(b""), "dataset_invalid"),
    (lambda rig: (rig["dataset"] / "2_ohwx dog" / "img1.txt").write_bytes(b"\xff\xfe"), "dataset_invalid"),
])
@pytest.mark.slow
def test_the_fakes_failures_are_classed_as_the_real_ones_are(rig, break_it, failure):
    from lora_worker.transcript.outcome import decide
    from lora_worker.transcript.parser import Progress

    break_it(rig)
    result = run_merged(rig, argv(rig))
    outcome = decide(returncode=result.returncode, progress=Progress(), log_tail=merged_lines(result))
    assert (result.returncode, outcome.failure_class.value if outcome.failure_class else None) == (1, failure), \
        outcome.error

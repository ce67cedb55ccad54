"""The fake trainer and launcher are doubles of real programs: held to the real captures and documented facts."""
from __future__ import annotations

import base64
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
from tests.helpers import DATA, install_fake_trainer, make_dataset, pid_alive, set_modes, wait_for, write_safetensors

ENV = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "250"}


@pytest.fixture
def rig(tmp_path: Path) -> dict:
    install = install_fake_trainer(tmp_path / "opt")
    model = tmp_path / "models" / "sdxl_random.safetensors"
    write_safetensors(model, {"model.diffusion_model.x": ("F16", [1])})
    # the capture's dataset: 3 images with captions in "2_ohwx dog"
    dataset = make_dataset(tmp_path / "train", "t1", "2_ohwx dog", images=3)
    return {**install, "model": model, "dataset": dataset, "out": tmp_path / "train" / "t1" / "output" / "run1"}


def argv(rig: dict, *extra: str, steps: int = 3) -> list[str]:
    """The real-run reference's command (run1), pointed at the rig."""
    return [str(rig["accelerate"]), "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision",
            "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "2", "sdxl_train_network.py",
            f"--pretrained_model_name_or_path={rig['model']}", f"--tokenizer_cache_dir={rig['tokenizer_cache_dir']}",
            f"--train_data_dir={rig['dataset']}", f"--output_dir={rig['out']}", "--output_name=ohwx",
            "--save_model_as=safetensors", "--caption_extension=.txt", "--resolution=256",
            "--network_module=networks.lora", "--network_dim=4", "--network_alpha=4", "--network_train_unet_only",
            "--cache_latents", "--cache_text_encoder_outputs", "--gradient_checkpointing", "--learning_rate=1e-4",
            "--lr_scheduler=cosine", "--seed=42", "--min_snr_gamma=5", "--noise_offset=0.1", "--max_grad_norm=1.0",
            "--sdpa", "--max_data_loader_n_workers=0", "--optimizer_type=AdamW", f"--max_train_steps={steps}",
            "--train_batch_size=1", "--console_log_simple", *extra]


def run(rig: dict, *extra: str, steps: int = 3, **modes: object) -> subprocess.CompletedProcess[bytes]:
    set_modes(rig["sd_scripts_dir"], **modes)
    return subprocess.run(argv(rig, *extra, steps=steps), cwd=rig["sd_scripts_dir"], env=ENV, capture_output=True,
                          timeout=60, start_new_session=True)


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


def test_stdout_has_the_lines_of_the_real_run_in_the_same_order(rig):
    result = run(rig)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert shape(result.stdout.decode()) == shape(capture("run1_simple", "stdout").decode())


def test_the_steps_bar_is_redrawn_like_tqdm_in_the_real_run(rig):
    result = run(rig, step_s=0.2)  # slower than tqdm's 0.1 s minimum interval, as real steps are
    redraws = [r for r in result.stderr.decode().split("\r") if r.startswith("steps:")]
    real = [r for r in capture("run1_simple", "stderr").decode().split("\r") if r.startswith("steps:")]
    pattern = re.compile(r"steps: +\d+%\|[^|]*\| \d+/\d+ \[[\d:]+<[\d:?]+, +[\d.?]+(it/s|s/it)(, avr_loss=[\d.]+)?\] *\n?$")
    assert all(pattern.match(r) for r in redraws + real)
    fake_n = [re.search(r"\| (\d+)/", r)[1] for r in redraws]  # type: ignore[index]
    real_n = [re.search(r"\| (\d+)/", r)[1] for r in real]  # type: ignore[index]
    assert fake_n == real_n == ["0", "1", "1", "2", "2", "3", "3", "3"]
    assert "avr_loss" not in redraws[1] and "avr_loss" in redraws[2]  # step 1's first redraw has no loss yet
    assert redraws[-1].endswith("\n") and not redraws[-2].endswith("\n")  # closed after "model saved."


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


def test_an_empty_train_data_dir_prints_what_the_capture_shows_and_exits_0_without_a_file(rig):
    shutil.rmtree(rig["dataset"] / "2_ohwx dog")  # the capture's case: train_data_dir holds nothing
    result = run(rig, bnb_warning=True)  # as on the capture box
    assert result.returncode == 0 and not rig["out"].exists()
    assert shape(result.stdout.decode()) == shape(capture("fail_empty_dataset", "stdout").decode())
    assert shape(result.stderr.decode()) == shape(capture("fail_empty_dataset", "stderr").decode())


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


def test_unknown_flags_exit_2_inside_and_1_outside(rig):
    result = run(rig, "--text_encoder_lr1=1e-5")
    assert result.returncode == 1
    err = result.stderr.decode()
    assert "sdxl_train_network.py: error: unrecognized arguments: --text_encoder_lr1=1e-5" in err
    assert "returned non-zero exit status 2." in err


def test_a_missing_model_fails_like_diffusers_does(rig):
    rig["model"].unlink()
    result = run(rig)
    assert result.returncode == 1
    assert b"is neither a valid local path nor a valid repo id" in result.stderr
    assert b"load Diffusers pretrained models:" in result.stdout
    assert b"returned non-zero exit status 1." in capture("fail_missing_model", "stderr")
    assert b"returned non-zero exit status 1." in result.stderr


def test_an_empty_caption_crashes_like_sd_scripts(rig):
    (rig["dataset"] / "2_ohwx dog" / "img1.txt").write_bytes(b"")
    result = run(rig)
    assert result.returncode == 1
    assert b"AssertionError: caption file is empty" in result.stderr
    assert b"AssertionError: caption file is empty" in capture("fail_empty_caption", "stderr")


def test_cuda_oom_reads_like_torch(rig):
    result = run(rig, oom_at_step=2)
    assert result.returncode == 1
    assert b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in result.stderr


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


def test_modes_reach_the_fake_through_a_file_not_the_environment(rig, tmp_path):
    record = tmp_path / "record.json"
    assert run(rig, record=str(record)).returncode == 0
    seen = json.loads(record.read_text())
    assert {k: seen["env"][k] for k in ENV} == ENV  # the launcher passed the environment through
    assert seen["env"]["OMP_NUM_THREADS"] == "2"
    assert seen["argv"][0].endswith("sdxl_train_network.py")

"""The fake trainer given the worker's `--dataset_config` held to the real one's (tests/data/rig/presented_*.jsonl,
made by tests/rig/test_real_presentation.py on the CPU rig): the same 3 images in `2_ohwx dog`, 10 steps at batch 1,
once by `--train_data_dir` (the folder's 2 repeats) and once by the worker's TOML (4 repeats). Compared: every
stdout line before training, in order, but for the paths and the device the fake stands in for."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lora_worker.dispatch.presentation import dataset_config_toml
from tests.helpers import SDXL_TINY, install_fake_trainer, make_dataset, set_modes, write_safetensors
from tests.helpers.fake_trainer import ENV
from lora_worker.host.safetensors import read_header
from tests.helpers.rig_captures import RIG, fake_argv, flag, meta, stream

pytestmark = pytest.mark.slow

CAPTURES = ("presented_folder", "presented_config")


@pytest.fixture
def rig(tmp_path: Path) -> dict:
    install = install_fake_trainer(tmp_path / "opt")
    model = tmp_path / "models" / "sdxl_random.safetensors"
    write_safetensors(model, SDXL_TINY)
    dataset = make_dataset(tmp_path / "train", "t3", "2_ohwx dog", images=3)
    config = tmp_path / "state" / "datasets" / "presented.toml"
    config.parent.mkdir(parents=True)
    config.write_bytes(dataset_config_toml(str(dataset / "2_ohwx dog"), "ohwx dog", 4))
    return {**install, "model": model, "dataset": dataset, "config": config,
            "out": tmp_path / "train" / "t3" / "output"}


def before_training(text: str, paths: dict[str, str]) -> list[str]:
    for path, shown in paths.items():
        text = text.replace(path, shown)
    lines = text.replace("accelerator device: cuda", "accelerator device: cpu").splitlines()
    end = next(i for i, line in enumerate(lines) if "total optimization steps" in line)
    return lines[:end + 1]


@pytest.mark.parametrize("name", CAPTURES)
def test_the_fake_prints_what_the_real_trainer_printed_before_training(rig, name):
    set_modes(rig["sd_scripts_dir"], step_s=0.0)
    done = subprocess.run(fake_argv(name, rig), cwd=rig["sd_scripts_dir"], env=ENV, capture_output=True,
                          timeout=60, start_new_session=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    real_argv = meta(name)["argv"]
    dataset = flag(real_argv, "dataset_config") if name.endswith("config") else flag(real_argv, "train_data_dir")
    real = before_training(stream(name, "stdout").decode(), {
        "/work/rig/tokenizers": "<tokenizers>", "/work/rig/models": "<models>",
        dataset: "<dataset>", "/worktank/arbo/train/t3/dataset": "<train>"})
    fake = before_training(done.stdout.decode(), {
        str(rig["tokenizer_cache_dir"]): "<tokenizers>", str(rig["model"].parent): "<models>",
        str(rig["config"] if name.endswith("config") else rig["dataset"]): "<dataset>", str(rig["dataset"]): "<train>"})
    assert fake == real


def test_the_fakes_lora_under_a_config_has_the_real_ones_metadata_keys_and_datasets(rig):
    """The final LoRA's `__metadata__` of the rig's run under the worker's config (tests/data/rig/
    final-lora-presented.header.json): the same keys, `ss_datasets` alike but for the tags the fake does not
    count (its captions are its own), and the counts of the repeats shown."""
    real = json.loads((RIG / "final-lora-presented.header.json").read_text())
    set_modes(rig["sd_scripts_dir"], step_s=0.0)
    argv = [a if not a.startswith("--max_train_steps=") else "--max_train_steps=10"
            for a in fake_argv("presented_config", rig)]
    done = subprocess.run(argv, cwd=rig["sd_scripts_dir"], env=ENV, capture_output=True, timeout=60,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    fake = read_header(rig["out"] / "ohwx.safetensors").metadata
    assert set(fake) == set(real)
    for key in ("ss_num_epochs", "ss_num_train_images", "ss_num_batches_per_epoch", "ss_dataset_dirs", "ss_steps",
                "ss_max_train_steps"):
        assert fake[key] == real[key], key
    fake_sets, real_sets = json.loads(fake["ss_datasets"]), json.loads(real["ss_datasets"])
    for datasets in (fake_sets, real_sets):
        datasets[0].pop("tag_frequency")
    assert fake_sets == real_sets

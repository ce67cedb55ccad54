"""The fake trainer (tests/fakes/) run directly, as accelerate would start it."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.helpers import DATA, SDXL_TINY, install_fake_trainer, make_dataset, set_modes, write_safetensors

FAKES = Path(__file__).resolve().parents[1] / "fakes"

ENV = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "250"}


def fake_rig(root: Path) -> dict:
    """The fake trainer installed under `root`, a tiny SDXL checkpoint and the captures' dataset (3 images with
    captions in `2_ohwx dog`: 6 steps an epoch at batch 1), as the real runs in tests/data were made."""
    install = install_fake_trainer(root / "opt")
    model = root / "models" / "sdxl_random.safetensors"
    write_safetensors(model, SDXL_TINY)
    dataset = make_dataset(root / "train", "t1", "2_ohwx dog", images=3)
    return {**install, "model": model, "dataset": dataset, "out": root / "train" / "t1" / "output" / "run1"}


def argv(rig: dict, *extra: str, steps: int = 3) -> list[str]:
    """The command of the real run run1 (tests/data/run1_simple.jsonl), pointed at the rig."""
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



def load_fake_trainer() -> ModuleType:
    """The fake trainer's module, imported here (its parser, its writers), with its helper modules beside it and
    the real headers it reads (an install copies them next to it) read from tests/data."""
    sys.path.insert(0, str(FAKES))
    try:
        spec = importlib.util.spec_from_file_location("fake_sdxl_train_network", FAKES / "sdxl_train_network.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        module.HERE = str(DATA)
        return module
    finally:
        sys.path.remove(str(FAKES))

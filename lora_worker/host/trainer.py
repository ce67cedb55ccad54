"""Is the sd-scripts installation complete? Checked before each dispatch and by `lora-worker doctor`."""
from __future__ import annotations

import os
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.errors import TrainerUnavailable

# The folder names strategy_base._load_tokenizer looks for inside --tokenizer_cache_dir.
TOKENIZER_DIRS = ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")


def missing_trainer_parts(settings: Settings) -> list[str]:
    """Human-readable descriptions of what is missing; empty when the trainer can run offline."""
    missing = []
    if not (settings.accelerate.is_file() and os.access(settings.accelerate, os.X_OK)):
        missing.append(f"accelerate launcher {settings.accelerate}")
    if not settings.train_script.is_file():
        missing.append(f"training script {settings.train_script}")
    for name in TOKENIZER_DIRS:
        if not _tokenizer_present(settings.tokenizer_cache_dir / name):
            missing.append(f"tokenizer {settings.tokenizer_cache_dir / name}")
    return missing


def require_trainer(settings: Settings) -> None:
    missing = missing_trainer_parts(settings)
    if missing:
        raise TrainerUnavailable("The trainer installation is incomplete: missing " + "; ".join(missing) + ".",
                                 missing=missing)


def _tokenizer_present(path: Path) -> bool:
    # Offline, transformers needs the vocabulary and merges; without them it fails with a bare TypeError.
    return (path / "vocab.json").is_file() and (path / "merges.txt").is_file()

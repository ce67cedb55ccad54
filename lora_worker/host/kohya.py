"""How sd-scripts reads a `--train_data_dir` (DreamBooth layout), as its own code decides it, so that what the
worker checks is exactly what the trainer will open.

- library/config_util.py `generate_dreambooth_subsets_config_by_subdirs`: every sub-directory (`is_dir()`,
  which follows links) whose `int(name.split("_")[0])` is at least 1 is a subset; Python's `int()` takes
  `" 3"`, `"+3"`, `"3 "` and other Unicode digits, so `" 3_x"` and `"3 _x"` are subsets too.
- library/train_util.py `glob_images`: `glob("*" + ext)` for each of IMAGE_EXTENSIONS, in the folder only
  (not recursive); glob is case-sensitive on Linux and `*` never matches a leading dot.
- The caption is `<image stem><caption_extension>` (the worker passes `.txt`).
"""
from __future__ import annotations

import os

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
GLOBBED_EXTENSIONS = frozenset(IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS))
CAPTION_EXTENSION = ".txt"


def subset_repeats(name: str) -> int | None:
    """The repeats sd-scripts would train a folder of this name with, or None if it would skip it."""
    try:
        repeats = int(name.split("_")[0])
    except ValueError:
        return None
    return repeats if repeats >= 1 else None


def is_trained_image(name: str) -> bool:
    """Whether sd-scripts' glob picks this file name up as an image."""
    return not name.startswith(".") and os.path.splitext(name)[1] in GLOBBED_EXTENSIONS


def caption_name(image: str) -> str:
    return os.path.splitext(image)[0] + CAPTION_EXTENSION


def folder_name(repeats: int, trigger: str, subject_class: str) -> str:
    """The kohya folder a request names: `10_ohwx woman` (repeats, then the class tokens)."""
    return f"{repeats}_{trigger} {subject_class}"

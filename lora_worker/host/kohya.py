"""How sd-scripts reads a `--train_data_dir` (DreamBooth layout), as its own code decides it, so that what the
worker checks is exactly what the trainer will open.

- library/config_util.py `generate_dreambooth_subsets_config_by_subdirs`: every sub-directory (`is_dir()`,
  which follows links) whose `int(name.split("_")[0])` is at least 1 is a subset; Python's `int()` takes
  `" 3"`, `"+3"`, `"3 "` and other Unicode digits, so `" 3_x"` and `"3 _x"` are subsets too.
- library/train_util.py `glob_images`: `glob("*" + ext)` for each of IMAGE_EXTENSIONS, in the folder only
  (not recursive); glob is case-sensitive on Linux and `*` never matches a leading dot.
- The caption is `<image stem><caption_extension>` (the worker passes `.txt`), or, when the stem has five or more
  `_`-separated tokens and that file is missing, the stem without its last four tokens (train_util.py
  `read_caption`, L1946-1970: the face-crop naming `name_x_y_w_h`).
- The image is opened by PIL (`load_image`, L2948-2962) and measured by `imagesize` (L1478-1490): both go by
  the file's content, not its name, so a PNG named `.JPG` is read as a PNG.
"""
from __future__ import annotations

import os
from collections.abc import Collection

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# train_util.py L104: each extension in lower and in upper case, nothing else; glob is case-sensitive on Linux.
GLOBBED_EXTENSIONS = frozenset(IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS))
# Image files sd-scripts' glob passes over without a word: another case (`.Jpg`), a format it globs only with a
# plugin the worker cannot see in the trainer's venv (L106-127: pillow_avif, jxlpy, pillow_jxl), or one it
# never globs. Someone put them there to be trained on; a job that silently leaves them out is refused.
SKIPPED_IMAGE_EXTENSIONS = frozenset((*IMAGE_EXTENSIONS, ".avif", ".jxl", ".gif", ".tif", ".tiff", ".heic", ".heif"))
CAPTION_EXTENSION = ".txt"
FACE_CROP_TOKENS = 5  # read_caption's `len(tokens) >= 5`: the stem's last four tokens are a crop box


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


def caption_candidates(image: str) -> tuple[str, ...]:
    """The caption files sd-scripts tries for this image, in its order; it reads the first that exists."""
    stem = os.path.splitext(image)[0]
    tokens = stem.split("_")
    face_crop = "_".join(tokens[:-4]) if len(tokens) >= FACE_CROP_TOKENS else stem
    return tuple(dict.fromkeys((stem + CAPTION_EXTENSION, face_crop + CAPTION_EXTENSION)))


def caption_file(image: str, names: Collection[str]) -> str:
    """The caption file sd-scripts reads for this image: the first candidate among `names`, else the plain one
    (which does not exist: the image has no caption)."""
    return next((c for c in caption_candidates(image) if c in names), caption_name(image))


def is_hidden_image(name: str) -> bool:
    """A dot-file with an image extension (`._img.jpeg`, macOS's AppleDouble litter from a zip): glob's `*` never
    matches a leading dot, so sd-scripts never sees it."""
    return name.startswith(".") and os.path.splitext(name)[1].lower() in SKIPPED_IMAGE_EXTENSIONS


def skipped_image(name: str) -> str | None:
    """Why sd-scripts' glob would leave out this image file without a word, or None (not skipped, or not an
    image file at all). Dot-files are left out too and stay unremarked: `._img.png` is macOS's litter."""
    suffix = os.path.splitext(name)[1]
    if name.startswith(".") or suffix in GLOBBED_EXTENSIONS or suffix.lower() not in SKIPPED_IMAGE_EXTENSIONS:
        return None
    if suffix.lower() in IMAGE_EXTENSIONS:
        return (f"sd-scripts globs {suffix.lower()} and {suffix.upper()} only, so it would skip this {suffix!r} file; "
                f"rename it to {suffix.lower()}")
    if suffix.lower() in (".avif", ".jxl"):
        return (f"sd-scripts reads {suffix.lower()} only with a Pillow plugin the worker cannot vouch for; "
                "convert it to PNG or JPEG")
    return f"sd-scripts does not read {suffix.lower()} images and would skip it; convert it to PNG or JPEG"


def folder_name(repeats: int, trigger: str, subject_class: str) -> str:
    """The kohya folder a request names: `10_ohwx woman` (repeats, then the class tokens)."""
    return f"{repeats}_{trigger} {subject_class}"

"""The dataset as sd-scripts will read it: `<dataset_dir>/<repeats>_<trigger> <class>/` with images and
`.txt` captions. Checked before a job is accepted, because sd-scripts reports most problems late or not at all
(no images: exit 0 and no file; a 0-byte caption: a crash after start-up).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lora_worker.errors import DatasetInvalid

# sd-scripts' extensions (library/train_util.py IMAGE_EXTENSIONS), matched case-insensitively.
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
CAPTION_EXTENSION = ".txt"
KOHYA_FOLDER = re.compile(r"^(\d+)_")

_MAGIC: dict[str, tuple[bytes, ...]] = {
    ".png": (b"\x89PNG\r\n\x1a\n",),
    ".jpg": (b"\xff\xd8\xff",),
    ".jpeg": (b"\xff\xd8\xff",),
    ".bmp": (b"BM",),
}


@dataclass(frozen=True)
class DatasetImage:
    name: str
    size: int
    caption: str | None  # the first line sd-scripts uses, or None when there is no caption file


@dataclass(frozen=True)
class DatasetManifest:
    """The images of the kohya folder, in name order; the fingerprint hashes this."""

    folder: str
    images: tuple[DatasetImage, ...]

    @property
    def image_count(self) -> int:
        return len(self.images)

    def sha256(self) -> str:
        doc = [{"name": i.name, "size": i.size, "caption": i.caption} for i in self.images]
        body = json.dumps({"folder": self.folder, "images": doc}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(body.encode()).hexdigest()


def inspect_dataset(dataset_dir: Path, folder_name: str) -> DatasetManifest:
    """Check the kohya folder and read its manifest; DatasetInvalid says what was expected."""
    folder = dataset_dir / folder_name
    _check_other_folders(dataset_dir, folder_name)
    if not folder.is_dir():
        raise DatasetInvalid({"dataset_dir": [
            f"Expected the folder {folder_name!r} (<repeats>_<trigger> <subject_class>) inside {dataset_dir}."]})
    images = [entry for entry in sorted(_entries(folder), key=lambda e: e.name)
              if entry.is_file() and Path(entry.name).suffix.lower() in IMAGE_EXTENSIONS]
    if not images:
        raise DatasetInvalid({"dataset_dir": [
            f"{folder_name!r} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))})."]})
    problems: list[str] = []
    manifest = []
    for entry in images:
        path = Path(entry.path)
        problem = _image_problem(path)
        caption, caption_problem = _read_caption(path.with_suffix(CAPTION_EXTENSION))
        problems += [p for p in (problem, caption_problem) if p]
        manifest.append(DatasetImage(entry.name, entry.stat().st_size, caption))
    if problems:
        shown = problems[:10] + ([f"… and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise DatasetInvalid({"dataset_dir": shown})
    return DatasetManifest(folder=folder_name, images=tuple(manifest))


def _check_other_folders(dataset_dir: Path, expected: str) -> None:
    # sd-scripts trains on every `<n>_name` folder with n >= 1; another one would change the run silently.
    others = sorted(e.name for e in _entries(dataset_dir)
                    if e.is_dir() and e.name != expected and (m := KOHYA_FOLDER.match(e.name)) and int(m[1]) > 0)
    if others:
        raise DatasetInvalid({"dataset_dir": [
            f"Holds other training folders {others}; only {expected!r} may be there."]})


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    # A folder the worker may not list (made 0700 by another user) is the request's problem: a 422, not a 500.
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError as exc:
        raise DatasetInvalid({"dataset_dir": [f"Cannot list {directory}: {exc.strerror}."]}) from exc


def _image_problem(path: Path) -> str | None:
    try:
        with path.open("rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        return f"{path.name}: unreadable ({exc.strerror})"
    if not head:
        return f"{path.name}: empty file"
    suffix = path.suffix.lower()
    if suffix == ".webp":
        ok = head[:4] == b"RIFF" and head[8:12] == b"WEBP"
    else:
        ok = head.startswith(_MAGIC[suffix])
    return None if ok else f"{path.name}: not a {suffix[1:]} image"


def _read_caption(path: Path) -> tuple[str | None, str | None]:
    """(first line, problem). sd-scripts asserts on a 0-byte caption and raises on non-UTF-8."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None  # sd-scripts then uses the folder's class tokens as the caption
    except OSError as exc:
        return None, f"{path.name}: unreadable ({exc.strerror})"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, f"{path.name}: caption is not UTF-8"
    first = text.splitlines()[0].strip() if text else ""
    if not first:
        return None, f"{path.name}: caption is empty (sd-scripts uses only its first line)"
    return first, None

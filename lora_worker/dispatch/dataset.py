"""The dataset as sd-scripts will read it: `<dataset_dir>/<repeats>_<trigger> <class>/` with images and
`.txt` captions. Checked before a job is accepted, because sd-scripts reports most problems late or not at all
(no images: exit 0 and no file; a 0-byte caption: a crash after start-up).

The dataset is written by arbo and its users, so it is read as a hostile party may have made it
(`lora_worker.host.fs`): no link is followed, nothing is opened that could block, and every entry the trainer
will open (the kohya folder, each image, each caption) must be a regular file or a real directory inside the
dataset. A link to a secret would otherwise be trained on, and its caption copied into the LoRA's metadata
(`ss_tag_frequency`), which arbo downloads.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from lora_worker.errors import DatasetInvalid
from lora_worker.findings import Finding
from lora_worker.host import fs, kohya

# The most a caption may hold. sd-scripts uses only its first line, and captions become LoRA metadata; a
# caption past this is refused rather than read (one linked to /dev/zero never ends).
CAPTION_MAX_BYTES = 64 * 1024
LINE_END = re.compile(r"\r\n|\r|\n")  # universal newlines, as a text-mode open reads them

# The formats of sd-scripts' extension list, by their first bytes. sd-scripts opens images by content (PIL's
# Image.open, imagesize), never by name: a PNG named `.JPG` trains as a PNG. PIL would open a GIF or TIFF
# too; the worker refuses those rather than vouch for them.
_MAGIC: tuple[tuple[str, bytes], ...] = (
    ("PNG", b"\x89PNG\r\n\x1a\n"), ("JPEG", b"\xff\xd8\xff"), ("BMP", b"BM"),
)


@dataclass(frozen=True)
class DatasetImage:
    name: str
    size: int
    caption: str | None  # the first line sd-scripts uses, or None when there is no caption file


@dataclass(frozen=True)
class DatasetManifest:
    """The images of the kohya folder, in name order; the fingerprint hashes this. The identities are those
    of the directories as they were checked; the supervisor refuses to start if either has been replaced."""

    folder: str
    images: tuple[DatasetImage, ...]
    dataset_id: fs.FileId | None = None
    folder_id: fs.FileId | None = None

    @property
    def image_count(self) -> int:
        return len(self.images)

    def sha256(self) -> str:
        doc = [{"name": i.name, "size": i.size, "caption": i.caption} for i in self.images]
        body = json.dumps({"folder": self.folder, "images": doc}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(body.encode()).hexdigest()

    def identities(self) -> dict[str, str | None]:
        """The ledger columns the pre-exec check compares against."""
        return {"dataset_dev_ino": str(self.dataset_id) if self.dataset_id else None,
                "kohya_dev_ino": str(self.folder_id) if self.folder_id else None}


def inspect_dataset(dataset_dir: Path, folder_name: str) -> DatasetManifest:
    """Check the kohya folder and read its manifest; DatasetInvalid says what was expected."""
    dataset_fd = _open_dataset(dataset_dir)
    try:
        entries = dict(_entries(dataset_fd, dataset_dir))
        _check_other_folders(entries, folder_name)
        folder_fd = _open_folder(dataset_fd, dataset_dir, folder_name, entries.get(folder_name))
        try:
            manifest = _read_folder(folder_fd, folder_name)
            return DatasetManifest(folder=folder_name, images=manifest,
                                   dataset_id=fs.FileId.of(os.fstat(dataset_fd)),
                                   folder_id=fs.FileId.of(os.fstat(folder_fd)))
        finally:
            os.close(folder_fd)
    finally:
        os.close(dataset_fd)


def _open_dataset(dataset_dir: Path) -> int:
    try:
        return fs.open_dir(str(dataset_dir))
    except fs.Refused as exc:
        raise DatasetInvalid({"dataset_dir": [f"{exc}; the dataset is read without following links."]}) from exc
    except OSError as exc:
        raise DatasetInvalid({"dataset_dir": [f"Cannot open {dataset_dir}: {exc.strerror or exc}."]}) from exc


def _check_other_folders(entries: dict[str, os.stat_result], expected: str) -> None:
    """sd-scripts takes every sub-directory whose name it reads as repeats >= 1 (its `is_dir()` follows links):
    another one would be trained on silently, and `image_count` would not count it."""
    problems = []
    for name, st in sorted(entries.items()):
        repeats = kohya.subset_repeats(name)
        if name == expected or repeats is None or not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            continue
        tokens = "_".join(name.split("_")[1:])
        problems.append(f"{name!r} ({fs.kind_of(st.st_mode)}): sd-scripts would train on it as another subset "
                        f"with {repeats} repeats and class tokens {tokens!r}; only {expected!r} may be there.")
    if problems:
        raise DatasetInvalid({"dataset_dir": problems[:10]})


def _open_folder(dataset_fd: int, dataset_dir: Path, name: str, st: os.stat_result | None) -> int:
    if st is None:
        raise DatasetInvalid({"dataset_dir": [
            f"Expected the folder {name!r} (<repeats>_<trigger> <subject_class>) inside {dataset_dir}."]})
    if not stat.S_ISDIR(st.st_mode):
        raise DatasetInvalid({"dataset_dir": [
            f"{name!r} is a {fs.kind_of(st.st_mode)}; the kohya folder must be a real directory in the dataset."]})
    try:
        return fs.open_subdir(dataset_fd, name)
    except OSError as exc:  # replaced since the listing, or not ours to read
        raise DatasetInvalid({"dataset_dir": [f"Cannot open {name!r}: {exc}."]}) from exc


def _read_folder(folder_fd: int, folder_name: str) -> tuple[DatasetImage, ...]:
    entries = dict(_entries(folder_fd, Path(folder_name)))
    trained = [name for name in sorted(entries) if kohya.is_trained_image(name)]
    images = [name for name in trained if _is_utf8(name)]
    problems = _name_problems(folder_name, trained)
    if not images and not problems:  # what sd-scripts' glob passes over is the lint's (dispatch/lint.py: file_skipped)
        _no_images(folder_name, entries)
    manifest = []
    for name in images:
        image, found = _read_image(folder_fd, name, entries)
        problems += [Finding(p.code, f"{folder_name}/{printable(p.file)}", p.message) for p in found]
        manifest.append(image)
    if problems:
        _refuse(problems)
    return tuple(manifest)


def _refuse(problems: list[Finding]) -> None:
    """DatasetInvalid listing the first ten problems in `fields`, and every one with its code in `details`."""
    listed = [str(p) for p in problems[:10]] + ([f"… and {len(problems) - 10} more"] if len(problems) > 10 else [])
    raise DatasetInvalid({"dataset_dir": listed}, findings=[p.as_dict() for p in problems])


def _no_images(folder_name: str, entries: dict[str, os.stat_result]) -> None:
    """sd-scripts would log `No data found` and exit 0 without a LoRA."""
    skipped = sum(1 for name in entries if kohya.skipped_image(name) or kohya.is_hidden_image(name))
    none = Finding("no_images", folder_name, f"holds no images ({', '.join(kohya.IMAGE_EXTENSIONS)}, or the same in "
                   "upper case)" + (f"; {skipped} image file(s) sd-scripts would skip" if skipped else ""))
    raise DatasetInvalid({"dataset_dir": [f"{folder_name!r} {none.message}."]}, findings=[none.as_dict()])


def _read_image(folder_fd: int, name: str, entries: dict[str, os.stat_result]) -> tuple[DatasetImage, list[Finding]]:
    """One image and its caption as sd-scripts pairs them, and what is wrong with either."""
    size, problem = _check_image(folder_fd, name, entries[name])
    # sd-scripts reads the first candidate that exists (`os.path.isfile`, which follows a link; the worker
    # refuses the link below instead)
    caption_file = kohya.caption_file(name, entries)
    caption, caption_problem = _read_caption(folder_fd, caption_file, entries.get(caption_file))
    return DatasetImage(name, size, caption), [p for p in (problem, caption_problem) if p]


def _entries(dir_fd: int, shown: Path) -> list[tuple[str, os.stat_result]]:
    # A folder the worker may not list (made 0700 by another user) is the request's problem: a 422, not a 500.
    try:
        return fs.list_entries(dir_fd)
    except OSError as exc:
        raise DatasetInvalid({"dataset_dir": [f"Cannot list {shown}: {exc.strerror or exc}."]}) from exc


def _check_image(folder_fd: int, name: str, st: os.stat_result) -> tuple[int, Finding | None]:
    """(size, problem). Only a regular file is opened, never through a link, and only its first bytes read."""
    if not stat.S_ISREG(st.st_mode):
        return 0, Finding("image_not_regular", name, f"a {fs.kind_of(st.st_mode)}; images must be regular files in "
                          "the dataset")
    try:
        fd, st = fs.open_regular(folder_fd, name)
    except OSError as exc:
        return 0, Finding("image_unreadable", name, f"unreadable ({exc.strerror or exc})")
    try:
        head = os.read(fd, 16)
    except OSError as exc:
        return st.st_size, Finding("image_unreadable", name, f"unreadable ({exc.strerror or exc})")
    finally:
        os.close(fd)
    if not head:
        return st.st_size, Finding("image_empty", name, "empty file")
    if image_format(head) is None:
        return st.st_size, Finding("image_format", name, "not an image sd-scripts can open (its content is none of "
                                   "PNG, JPEG, WebP, BMP)")
    return st.st_size, None


def _name_problems(folder_name: str, trained: list[str]) -> list[Finding]:
    """The images whose names cannot be recorded: sd-scripts would train on an image whose name is not UTF-8
    (os.listdir gives its bytes as surrogates), but no manifest, ledger row or JSON answer holds that name as it is,
    so the worker cannot say what it trains and refuses. (The files sd-scripts would skip without a word are the
    lint's warnings: dispatch/lint.py.)"""
    return [Finding("image_name_not_utf8", f"{folder_name}/{printable(name)}", "the file name is not UTF-8; rename it")
            for name in trained if not _is_utf8(name)]


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str) -> str:
    """A name as a message shows it: bytes that are not UTF-8 (a surrogate escape of os.listdir) as `\\xff`."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def first_line(text: str) -> str:
    """The caption sd-scripts trains on: `open(path, "rt", encoding="utf-8").readlines()[0].strip()`
    (train_util.py read_caption), lines ended by universal newlines only (\\n, \\r, \\r\\n; str.splitlines also
    ends one at \\x0b, \\x0c, \\x1c-\\x1e, \\x85, U+2028 and U+2029, which sd-scripts leaves in the caption)."""
    return LINE_END.split(text, maxsplit=1)[0].strip()


def image_format(head: bytes) -> str | None:
    """The format PIL would open these first bytes as, or None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    return next((kind for kind, magic in _MAGIC if head.startswith(magic)), None)


def _read_caption(folder_fd: int, name: str, st: os.stat_result | None) -> tuple[str | None, Finding | None]:
    """(first line, problem). sd-scripts asserts on a 0-byte caption and raises on non-UTF-8."""
    if st is None:
        return None, None  # sd-scripts then uses the folder's class tokens as the caption
    if not stat.S_ISREG(st.st_mode):
        return None, Finding("caption_not_regular", name, f"a {fs.kind_of(st.st_mode)}; captions must be regular "
                             "files in the dataset")
    try:
        fd, _ = fs.open_regular(folder_fd, name)
    except OSError as exc:
        return None, Finding("caption_unreadable", name, f"unreadable ({exc.strerror or exc})")
    try:
        data = fs.read_capped(fd, CAPTION_MAX_BYTES)
    except fs.Refused:
        return None, Finding("caption_too_large", name, f"caption is larger than {CAPTION_MAX_BYTES // 1024} KiB")
    except OSError as exc:
        return None, Finding("caption_unreadable", name, f"unreadable ({exc.strerror or exc})")
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, Finding("caption_not_utf8", name, "caption is not UTF-8")
    first = first_line(text)
    if not first:
        return None, Finding("caption_empty", name, "caption is empty (sd-scripts uses only its first line)")
    return first, None

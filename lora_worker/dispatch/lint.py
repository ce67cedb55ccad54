"""The dataset lint: what sd-scripts would crash on, drop in silence or train otherwise than meant, found file by file
before any GPU time (issue 34), on a dataset `inspect_dataset` passed (its files are regular, its captions UTF-8).

Each image is read whole (no link followed, nothing that blocks: host/fs.py), hashed, and decoded by Pillow, the
library and version the trainer decodes it with (train_util.py `load_image`, L2948-2961): `verify` (a PNG's chunk
CRCs), then `load` (every pixel). A truncated or corrupt image is refused here rather than found by the trainer at
`caching latents`, after it loaded a 7 GB model. Its size is Pillow's, as sd-scripts' `imagesize` reads it (both
take the header's size, no EXIF rotation), and its bucket is sd-scripts' own arithmetic (dispatch/buckets.py).

Bounded, for the largest dataset the limits allow: at most MAX_IMAGES images of MAX_IMAGE_BYTES each and
MAX_DATASET_BYTES in all (each a 422 past it), one image in memory at a time, none decoded past DECODE_PIXELS (the
size at which the trainer's Pillow starts to warn of a decompression bomb: 358 MB as 32-bit RGBX), and no decoding
once DECODE_SECONDS have been spent: the images left are measured from their headers and said to be unverified.
"""
from __future__ import annotations

import hashlib
import io
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from lora_worker.dispatch.buckets import Bucket, NoBucket, select_bucket
from lora_worker.dispatch.dataset import DatasetManifest, printable
from lora_worker.config import Settings
from lora_worker.errors import DatasetInvalid, TrainerUnavailable
from lora_worker.findings import Finding
from lora_worker.host import fs, kohya
from lora_worker.host.clip_tokens import CONTENT_TOKENS, CaptionCounter, load_counter
from lora_worker.host.trainer import FileUnusable, require_trainer

MAX_IMAGES = 1000
MAX_IMAGE_BYTES = 64 * 1024 * 1024
MAX_DATASET_BYTES = 4 * 1024 ** 3
DECODE_PIXELS = 89_478_485  # Pillow's MAX_IMAGE_PIXELS default, which the trainer's Pillow keeps
TRAINER_PIXEL_LIMIT = 2 * DECODE_PIXELS  # past it the trainer's Image.open raises DecompressionBombError
DECODE_SECONDS = 60.0
FORMATS = ("PNG", "JPEG", "WEBP", "BMP")  # the plugins dataset.py's magic bytes admit; no other parses these bytes
SHOWN_ERRORS = 10
# An image is small under half the tier's area: SDXL's own shapes (1216x832 at 1024) are a few percent under it and
# train as well; one far under it trains at its own size under --bucket_no_upscale, in a bucket of its own.
SMALL_AREA = 0.5

# The lint measures and bounds pixels itself (above), before anything is decoded; Pillow's own check would raise
# before it says the size, or warn through the process-wide warnings filter.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class ImageFacts:
    """One image as the lint found it: its size (None if unreadable), its bucket, its sha256."""

    name: str
    size: tuple[int, int] | None
    bucket: Bucket | None
    sha256: str


@dataclass
class LintReport:
    images: list[ImageFacts] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    decoded: int = 0
    seconds: float = 0.0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.is_error]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if not f.is_error]

    def buckets(self) -> list[Bucket]:
        return [i.bucket for i in self.images if i.bucket is not None]

    def raise_errors(self) -> None:
        """DatasetInvalid naming every error (the first few in `fields`, all in `details.findings`)."""
        errors = self.errors
        if errors:
            shown = [str(e) for e in errors[:SHOWN_ERRORS]]
            more = [f"… and {len(errors) - SHOWN_ERRORS} more"] if len(errors) > SHOWN_ERRORS else []
            raise DatasetInvalid({"dataset_dir": shown + more}, findings=[f.as_dict() for f in self.findings])


def caption_counter(settings: Settings) -> CaptionCounter:
    """The trainer's two tokenizers (`tokenizer_cache_dir`); a broken one is the trainer's problem, a 503 naming
    every file that fails (the preflight's own), not only the first the counter met."""
    try:
        return load_counter(settings.tokenizer_cache_dir)
    except FileUnusable as exc:
        require_trainer(settings)
        raise TrainerUnavailable(f"The trainer installation is incomplete or broken: {exc}.",
                                 missing=[str(exc)]) from exc


def lint_dataset(dataset_dir: Path, manifest: DatasetManifest, *, resolution: int, counter: CaptionCounter,
                 decode_seconds: float = DECODE_SECONDS, clock: Callable[[], float] = time.monotonic) -> LintReport:
    """Every finding about the dataset `inspect_dataset` read as `manifest`, for a tier of this resolution."""
    report = LintReport(findings=_limits(manifest))
    if report.errors:
        return report
    started = clock()
    folder_fd = _open_folder(dataset_dir, manifest)
    try:
        entries = dict(fs.list_entries(folder_fd))
        report.findings += _skipped(manifest.folder, entries)
        for image in manifest.images:
            decode = clock() - started < decode_seconds
            facts, found = inspect_image(folder_fd, image.name, resolution, decode=decode)
            report.decoded += decode and not any(f.code == "image_not_verified" for f in found)
            report.images.append(facts)
            report.findings += [Finding(f.code, f"{manifest.folder}/{f.file}", f.message) for f in found]
    finally:
        os.close(folder_fd)
    report.findings += _duplicates(manifest.folder, report.images)
    report.findings += _captions(manifest, entries, counter)
    report.seconds = round(clock() - started, 3)
    return report


def _limits(manifest: DatasetManifest) -> list[Finding]:
    total = sum(i.size for i in manifest.images)
    found = []
    if manifest.image_count > MAX_IMAGES:
        found.append(Finding("too_many_images", manifest.folder, f"{manifest.image_count} images; a dataset may "
                             f"hold {MAX_IMAGES}"))
    if total > MAX_DATASET_BYTES:
        found.append(Finding("dataset_too_large", manifest.folder, f"{total} bytes of images; a dataset may hold "
                             f"{MAX_DATASET_BYTES} (4 GiB)"))
    return found


def _open_folder(dataset_dir: Path, manifest: DatasetManifest) -> int:
    """The kohya folder `inspect_dataset` checked, and no other: its identity must be the one it recorded."""
    try:
        dataset_fd = fs.open_dir(str(dataset_dir))
        try:
            folder_fd = fs.open_subdir(dataset_fd, manifest.folder)
        finally:
            os.close(dataset_fd)
    except OSError as exc:
        raise DatasetInvalid({"dataset_dir": [f"{manifest.folder!r} cannot be opened again: {exc}."]}) from exc
    if manifest.folder_id is not None and fs.FileId.of(os.fstat(folder_fd)) != manifest.folder_id:
        os.close(folder_fd)
        raise DatasetInvalid({"dataset_dir": [f"{manifest.folder!r} was replaced while it was checked."]})
    return folder_fd


def inspect_image(folder_fd: int, name: str, resolution: int, *, decode: bool = True) -> tuple[ImageFacts,
                                                                                               list[Finding]]:
    """One image: its bytes, its size, its bucket, and (with `decode`, within DECODE_PIXELS) every pixel."""
    try:
        fd, st = fs.open_regular(folder_fd, name)
    except OSError as exc:
        return ImageFacts(name, None, None, ""), [Finding("image_unreadable", name, f"unreadable ({exc})")]
    try:
        data = fs.read_capped(fd, MAX_IMAGE_BYTES)
    except fs.Refused:
        return ImageFacts(name, None, None, ""), [Finding("image_too_large", name, f"{st.st_size} bytes; an image "
                                                          f"may have {MAX_IMAGE_BYTES} (64 MiB)")]
    except OSError as exc:
        return ImageFacts(name, None, None, ""), [Finding("image_unreadable", name, f"unreadable ({exc})")]
    finally:
        os.close(fd)
    digest = hashlib.sha256(data).hexdigest()
    size, found = _size(data, name)
    if size is None:
        return ImageFacts(name, None, None, digest), found
    bucket, found_bucket = _bucket(name, size, resolution)
    found += found_bucket
    if not any(f.is_error for f in found):  # a small image is decoded as any other
        found += _decode(data, name, size) if decode else [_unverified(name, size, "the lint's time ran out")]
    return ImageFacts(name, size, bucket, digest), found


def _size(data: bytes, name: str) -> tuple[tuple[int, int] | None, list[Finding]]:
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            width, height = im.size
    except Exception as exc:  # noqa: BLE001 - hostile bytes: Pillow's plugins raise many kinds
        return None, [Finding("image_size_unreadable", name, f"Pillow cannot read its size: {_said(exc)}")]
    if width * height > TRAINER_PIXEL_LIMIT:
        return (width, height), [Finding("image_too_many_pixels", name, f"{width}x{height} = {width * height} "
                                         f"pixels; the trainer's Pillow opens {TRAINER_PIXEL_LIMIT} at most")]
    return (width, height), []


def _bucket(name: str, size: tuple[int, int], resolution: int) -> tuple[Bucket | None, list[Finding]]:
    try:
        bucket = select_bucket(*size, resolution)
    except NoBucket as exc:
        return None, [Finding("image_edge_under_64", name, f"{exc}: an edge under 64 px at the size it trains at")]
    if size[0] * size[1] < SMALL_AREA * resolution * resolution:
        w, h = bucket.resolution
        return bucket, [Finding("image_small", name, f"{size[0]}x{size[1]} is under half the tier's {resolution}x"
                                f"{resolution}: it trains at its own size, in bucket {w}x{h}")]
    return bucket, []


def _decode(data: bytes, name: str, size: tuple[int, int]) -> list[Finding]:
    if size[0] * size[1] > DECODE_PIXELS:
        return [_unverified(name, size, f"over the {DECODE_PIXELS} pixels the lint decodes")]
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            im.verify()
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            im.load()
    except Exception as exc:  # noqa: BLE001 - hostile bytes: Pillow's plugins raise many kinds
        return [Finding("image_undecodable", name, f"Pillow cannot decode it: {_said(exc)}; the trainer would "
                        "die on it at `caching latents`")]
    return []


def _unverified(name: str, size: tuple[int, int], why: str) -> Finding:
    return Finding("image_not_verified", name, f"{size[0]}x{size[1]}, not decoded: {why}")


def _said(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}" if str(exc) else type(exc).__name__


def _skipped(folder: str, entries: dict[str, os.stat_result]) -> list[Finding]:
    found = []
    for name in sorted(entries):
        why = kohya.skipped_image(name)
        if why is None and kohya.is_hidden_image(name):
            why = "a dot-file (macOS leaves ._ files in zips): glob's * never matches a leading dot"
        if why is not None:
            found.append(Finding("file_skipped", f"{folder}/{printable(name)}", why))
    return found


def _duplicates(folder: str, images: list[ImageFacts]) -> list[Finding]:
    first: dict[str, str] = {}
    found = []
    for image in images:
        if not image.sha256:
            continue
        if image.sha256 in first:
            found.append(Finding("image_duplicate", f"{folder}/{image.name}",
                                 f"the same bytes as {first[image.sha256]} (sha256 {image.sha256[:16]}…)"))
        else:
            first[image.sha256] = image.name
    return found


def _captions(manifest: DatasetManifest, entries: dict[str, os.stat_result], counter: CaptionCounter) -> list[Finding]:
    found = []
    readers: dict[str, list[str]] = defaultdict(list)
    for image in manifest.images:
        caption_file = kohya.caption_file(image.name, entries)
        readers[caption_file].append(image.name)
        if image.caption is None:
            found.append(Finding("caption_missing", f"{manifest.folder}/{image.name}",
                                 f"no {kohya.caption_name(image.name)}: sd-scripts captions it with the class tokens"))
        elif (tokens := counter.count(image.caption)) > CONTENT_TOKENS:
            found.append(Finding("caption_truncated", f"{manifest.folder}/{caption_file}",
                                 f"{tokens} CLIP tokens; the text encoders read the first {CONTENT_TOKENS}"))
    for caption_file, names in readers.items():
        if len(names) > 1:
            found.append(Finding("caption_shared", f"{manifest.folder}/{caption_file}",
                                 f"read by {len(names)} images: {', '.join(names[:5])}"))
    return found

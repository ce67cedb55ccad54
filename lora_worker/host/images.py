"""The sample images in a job's output directory (`<output_dir>/sample/`), read without trusting the train root,
and the contact sheet drawn from them (issue 33, docs/samples.md).

The output directory is arbo's: `sample` may be a link, a name a FIFO, a file huge or not a PNG. So the folder is
reached without following a link (host/fs.py, the output directory held to its recorded identity), a file is opened
without following a link or blocking and read up to MAX_SAMPLE_BYTES, and an image counts only once Pillow has
decoded it whole, within MAX_SIDE a side. The contact sheet is bounded the same way: at most MAX_SHEET_ROWS steps
(the first, the last and evenly between) by the prompts, each a THUMB px thumbnail.
"""
from __future__ import annotations

import errno
import io
import os
from collections.abc import Sequence

from lora_worker.host import fs

SAMPLE_DIR = "sample"
MAX_SAMPLE_BYTES = 32 << 20  # a 2048 px RGB PNG of noise is ~12 MB; sd-scripts' images are far smaller
MIN_SIDE, MAX_SIDE = 64, 4096  # sd-scripts draws at least 64 px (train_util.py L6540-6541)
MAX_SHEET_ROWS = 12
THUMB = 192
LABEL_W, HEADER_H, PAD = 96, 28, 4


class ImageInvalid(ValueError):
    """Not a PNG Pillow decodes whole, within the bounds."""


def open_sample_dir(output_dir: str, output_id: str | None) -> int:
    """The job's `sample` folder, opened without following a link anywhere on its path, inside the output directory
    the job wrote into (its recorded identity); the caller closes it. FileNotFoundError while there is none."""
    out = fs.open_dir(output_dir)
    try:
        if output_id is not None and str(fs.FileId.of(os.fstat(out))) != output_id:
            raise fs.Refused(errno.EXDEV, f"{output_dir} is not the directory the job wrote into")
        return fs.open_subdir(out, SAMPLE_DIR, shown=f"{output_dir}/{SAMPLE_DIR}")
    finally:
        os.close(out)


def sample_names(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """The regular files of the folder with their lstat (links, FIFOs and folders left out)."""
    return [(name, st) for name, st in fs.list_entries(dir_fd) if fs.kind_of(st.st_mode) == "regular file"]


def read_sample(dir_fd: int, name: str) -> bytes:
    """The file's bytes: opened without following a link or blocking, a regular file of at most MAX_SAMPLE_BYTES
    (fs.Refused otherwise)."""
    fd, st = fs.open_regular(dir_fd, name)
    try:
        if st.st_size > MAX_SAMPLE_BYTES:
            raise fs.Refused(errno.EFBIG, f"{name} is {st.st_size} bytes, more than {MAX_SAMPLE_BYTES}")
        return fs.read_capped(fd, MAX_SAMPLE_BYTES)
    finally:
        os.close(fd)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG decoded whole (every row inflated and its chunks read to the end)."""
    from PIL import Image, UnidentifiedImageError  # loaded only where images are read

    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            width, height = image.size
            if not (MIN_SIDE <= width <= MAX_SIDE and MIN_SIDE <= height <= MAX_SIDE):
                raise ImageInvalid(f"{width}x{height} is outside {MIN_SIDE}-{MAX_SIDE} px a side")
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageInvalid(f"not a whole PNG: {exc}") from exc
    return width, height


def sheet_rows(steps: Sequence[int]) -> list[int]:
    """The steps the sheet shows: all, or MAX_SHEET_ROWS of them (the first, the last and evenly between)."""
    if len(steps) <= MAX_SHEET_ROWS:
        return list(steps)
    last = len(steps) - 1
    return [steps[round(i * last / (MAX_SHEET_ROWS - 1))] for i in range(MAX_SHEET_ROWS)]


def contact_sheet(rows: Sequence[tuple[str, Sequence[bytes | None]]], columns: Sequence[str]) -> bytes:
    """A PNG: one row per (label, images), one column per prompt, each image a thumbnail (a grey cell where one is
    missing), the labels drawn in Pillow's default font."""
    from PIL import Image, ImageDraw

    width = LABEL_W + len(columns) * (THUMB + PAD) + PAD
    height = HEADER_H + len(rows) * (THUMB + PAD) + PAD
    sheet = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for c, label in enumerate(columns):
        draw.text((LABEL_W + c * (THUMB + PAD) + PAD, 8), label[:30], fill=(0, 0, 0))
    for r, (label, images) in enumerate(rows):
        top = HEADER_H + r * (THUMB + PAD)
        draw.text((PAD, top + THUMB // 2 - 6), label, fill=(0, 0, 0))
        for c, data in enumerate(images):
            left = LABEL_W + c * (THUMB + PAD) + PAD
            if data is None:
                draw.rectangle((left, top, left + THUMB - 1, top + THUMB - 1), fill=(200, 200, 200))
                continue
            with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
                image.thumbnail((THUMB, THUMB))
                sheet.paste(image.convert("RGB"), (left, top))
    out = io.BytesIO()
    sheet.save(out, format="PNG", optimize=True)
    return out.getvalue()

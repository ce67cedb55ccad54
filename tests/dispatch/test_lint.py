"""The dataset lint (dispatch/lint.py): each finding class on images made here, with the file it concerns.

What each finding claims of the real trainer is proven on the rig (tests/rig/test_real_buckets.py: a truncated image
kills it at caching latents, an edge under 64 px or an unreadable size at make buckets; test_real_tokens.py: a
caption over 75 tokens is truncated by its tokenizers)."""
from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from lora_worker.dispatch import lint
from lora_worker.dispatch.dataset import inspect_dataset
from lora_worker.errors import DatasetInvalid
from lora_worker.host.clip_tokens import load_counter
from tests.helpers.captions import clip_tokenizer_cache

FOLDER = "10_ohwx woman"
LONG = ", ".join(["masterpiece best quality portrait of ohwx woman"] * 12)  # 96 tokens


def image(width: int = 800, height: int = 800, fmt: str = "PNG", colour: tuple[int, int, int] = (90, 120, 150)
          ) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, fmt)
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header says width x height, with one small IDAT: Pillow reads its size, never its pixels here."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    return load_counter(clip_tokenizer_cache(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def folder(tmp_path) -> Path:
    target = tmp_path / "dataset" / FOLDER
    target.mkdir(parents=True)
    return target


def put(folder: Path, name: str, data: bytes, caption: str | None = "ohwx woman, portrait") -> None:
    (folder / name).write_bytes(data)
    if caption is not None:
        (folder / (name.rsplit(".", 1)[0] + ".txt")).write_text(caption + "\n")


def run(folder: Path, counter, resolution: int = 768, **kwargs) -> lint.LintReport:
    manifest = inspect_dataset(folder.parent, FOLDER)
    return lint.lint_dataset(folder.parent, manifest, resolution=resolution, counter=counter, **kwargs)


def found(report: lint.LintReport) -> set[tuple[str, str]]:
    return {(f.code, f.file) for f in report.findings}


def test_a_clean_dataset_has_no_finding_and_every_image_decoded(folder, counter):
    put(folder, "a.png", image(1024, 1024))
    put(folder, "b.jpg", image(900, 700, "JPEG"))
    report = run(folder, counter)
    assert report.findings == [] and report.decoded == 2
    assert [i.bucket.resolution for i in report.images if i.bucket] == [(768, 768), (832, 640)]


@pytest.mark.parametrize("name, cut, code", [("a.png", 0.6, "image_undecodable"), ("a.jpg", 0.5, "image_undecodable"),
                                             ("a.webp", 0.5, "image_size_unreadable")])  # libwebp decodes at open
def test_a_truncated_image_is_an_error(folder, counter, name, cut, code):
    fmt = {"png": "PNG", "jpg": "JPEG", "webp": "WEBP"}[name.rsplit(".", 1)[1]]
    noisy = io.BytesIO()
    Image.effect_noise((800, 800), 60).convert("RGB").save(noisy, fmt)
    data = noisy.getvalue()
    put(folder, name, data[: int(len(data) * cut)])
    put(folder, "ok.png", image())
    report = run(folder, counter)
    assert found(report) >= {(code, f"{FOLDER}/{name}")}
    assert [f.code for f in report.errors] == [code]
    with pytest.raises(DatasetInvalid) as refused:
        report.raise_errors()
    assert refused.value.details["findings"][0]["code"] == code
    assert f"{FOLDER}/{name}" in refused.value.fields["dataset_dir"][0]


def test_a_png_whose_chunk_fails_its_crc_is_an_error(folder, counter):
    data = bytearray(image())
    data[-20] ^= 0xFF  # inside the last IDAT
    put(folder, "a.png", bytes(data))
    assert {f.code for f in run(folder, counter).errors} == {"image_undecodable"}


def test_an_image_whose_size_cannot_be_read_is_an_error(folder, counter):
    put(folder, "a.png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    put(folder, "b.jpg", b"\xff\xd8\xff" + b"\x00" * 64)
    assert found(run(folder, counter)) == {("image_size_unreadable", f"{FOLDER}/a.png"),
                                           ("image_size_unreadable", f"{FOLDER}/b.jpg")}


@pytest.mark.parametrize("size", [(200, 40), (40, 200), (63, 63), (20000, 20)])
def test_an_edge_under_64_px_at_the_size_it_trains_is_an_error(folder, counter, size):
    put(folder, "a.png", image(*size))
    assert {(f.code, f.file) for f in run(folder, counter).errors} == {("image_edge_under_64", f"{FOLDER}/a.png")}


def test_an_image_past_the_trainers_pixel_limit_is_an_error_past_the_lints_bound_unverified(folder, counter):
    put(folder, "huge.png", png_header_only(14000, 13000))  # 182 M pixels: past 2 x 89,478,485
    put(folder, "big.png", png_header_only(9500, 9500))  # 90.25 M: the trainer decodes it, the lint does not
    put(folder, "ok.png", image(1100, 1100))
    report = run(folder, counter, resolution=1024)
    assert found(report) == {("image_too_many_pixels", f"{FOLDER}/huge.png"),
                             ("image_not_verified", f"{FOLDER}/big.png")}
    big = next(i for i in report.images if i.name == "big.png")
    assert big.size == (9500, 9500) and big.bucket is not None and big.bucket.resolution == (1024, 1024)


def test_past_the_time_budget_images_are_measured_not_decoded(folder, counter):
    for i in range(3):
        put(folder, f"a{i}.png", image(800, 800, colour=(i, i, i)))
    ticks = iter(range(100))
    report = run(folder, counter, decode_seconds=1.5, clock=lambda: float(next(ticks)))
    assert report.decoded == 1
    assert [f.code for f in report.findings] == ["image_not_verified", "image_not_verified"]
    assert all(i.bucket is not None for i in report.images)


def test_a_small_image_is_a_warning_naming_its_bucket(folder, counter):
    put(folder, "a.png", image(500, 300))
    report = run(folder, counter)
    assert report.errors == [] and found(report) == {("image_small", f"{FOLDER}/a.png")}
    assert "bucket 448x256" in report.findings[0].message


def test_small_is_under_half_the_tiers_area_not_sdxls_own_shapes(folder, counter):
    put(folder, "sdxl.png", image(1216, 832))  # 3.5 % under 1024²: one of SDXL's own training shapes
    put(folder, "half.png", image(700, 700, colour=(1, 1, 1)))  # 47 % of 1024²
    assert found(run(folder, counter, resolution=1024)) == {("image_small", f"{FOLDER}/half.png")}


def test_exact_duplicates_are_warnings_naming_the_first(folder, counter):
    put(folder, "a.png", image())
    put(folder, "b.png", image())
    put(folder, "c.png", image(colour=(1, 2, 3)))
    report = run(folder, counter)
    assert found(report) == {("image_duplicate", f"{FOLDER}/b.png")}
    assert "a.png" in report.findings[0].message


def test_captions_missing_over_75_tokens_and_shared_are_warnings(folder, counter):
    put(folder, "a.png", image(colour=(1, 1, 1)), caption=None)
    put(folder, "b.png", image(colour=(2, 2, 2)), caption=LONG)
    put(folder, "c.png", image(colour=(3, 3, 3)))
    (folder / "c.jpg").write_bytes(image(fmt="JPEG"))  # reads c.txt too
    report = run(folder, counter)
    assert report.errors == []
    assert found(report) == {("caption_missing", f"{FOLDER}/a.png"), ("caption_truncated", f"{FOLDER}/b.txt"),
                             ("caption_shared", f"{FOLDER}/c.txt")}
    truncated = next(f for f in report.findings if f.code == "caption_truncated")
    assert truncated.message.startswith(f"{counter.count(LONG)} CLIP tokens") and counter.count(LONG) > 75


def test_files_sd_scripts_skips_are_warnings(folder, counter):
    put(folder, "a.png", image())
    for name in ("b.Jpg", "c.heic", "._a.png", "d.gif"):
        (folder / name).write_bytes(b"whatever")
    (folder / "notes.md").write_text("not an image: not a finding")
    report = run(folder, counter)
    assert found(report) == {("file_skipped", f"{FOLDER}/{n}") for n in ("b.Jpg", "c.heic", "._a.png", "d.gif")}


def test_a_folder_of_skipped_files_only_is_no_images(folder, counter):
    (folder / "a.HEIC").write_bytes(b"whatever")
    with pytest.raises(DatasetInvalid) as refused:
        inspect_dataset(folder.parent, FOLDER)
    assert refused.value.details["findings"] == [{
        "code": "no_images", "severity": "error", "file": FOLDER, "message": refused.value.details["findings"][0][
            "message"]}]
    assert "1 image file(s) sd-scripts would skip" in refused.value.details["findings"][0]["message"]


@pytest.mark.parametrize("limit, value, code", [("MAX_IMAGES", 2, "too_many_images"),
                                                 ("MAX_DATASET_BYTES", 1000, "dataset_too_large")])
def test_past_the_dataset_limits_nothing_is_read_and_it_is_an_error(folder, counter, monkeypatch, limit, value, code):
    for i in range(3):
        put(folder, f"a{i}.png", image(colour=(i, 0, 0)))
    monkeypatch.setattr(lint, limit, value)
    report = run(folder, counter)
    assert [(f.code, f.file) for f in report.findings] == [(code, FOLDER)] and report.images == []


def test_an_image_past_the_file_size_limit_is_an_error(folder, counter, monkeypatch):
    put(folder, "a.png", image())
    monkeypatch.setattr(lint, "MAX_IMAGE_BYTES", 100)
    assert found(run(folder, counter)) == {("image_too_large", f"{FOLDER}/a.png")}


def test_a_folder_replaced_after_the_check_is_refused(folder, counter):
    put(folder, "a.png", image())
    manifest = inspect_dataset(folder.parent, FOLDER)
    folder.rename(folder.parent / "old")
    (folder.parent / FOLDER).mkdir()
    with pytest.raises(DatasetInvalid, match="replaced"):
        lint.lint_dataset(folder.parent, manifest, resolution=768, counter=counter)


def test_a_name_that_is_not_utf8_is_an_error_for_an_image_and_shown_escaped_when_skipped(folder, counter):
    put(folder, "a.png", image())
    with open(os.fsencode(folder) + b"/b\xff.Jpg", "wb") as skipped:  # skipped by the glob: a warning, escaped
        skipped.write(b"x")
    report = run(folder, counter)
    assert found(report) == {("file_skipped", f"{FOLDER}/b\\xff.Jpg")}
    with open(os.fsencode(folder) + b"/c\xfe.png", "wb") as unnamed:
        unnamed.write(image())
    with pytest.raises(DatasetInvalid) as refused:
        inspect_dataset(folder.parent, FOLDER)
    assert [(f["code"], f["file"]) for f in refused.value.details["findings"]] == [
        ("image_name_not_utf8", f"{FOLDER}/c\\xfe.png")]

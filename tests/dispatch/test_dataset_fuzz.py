"""The dataset check is total: whatever names and bytes arbo's folders hold (any bytes in a name, invalid UTF-8
and newlines included, names of 255 bytes, links, FIFOs, directories named like images, captions of any bytes
around the size bound, NUL bytes, other encodings), `inspect_dataset` returns a manifest or raises DatasetInvalid.
And a manifest it returns is what sd-scripts will read: the images its glob finds, each with the caption its
`read_caption` returns (both re-done here as sd-scripts' own code does them, train_util.py L1946-1970 and
L2847-2856). The budget is the Hypothesis profile's (tests/helpers/fuzz.py)."""
from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import example, given, strategies as st

from lora_worker.dispatch.dataset import CAPTION_MAX_BYTES, inspect_dataset
from lora_worker.errors import DatasetInvalid
from lora_worker.host import kohya
from tests.helpers import png_bytes

pytestmark = pytest.mark.fuzz

FOLDER = "10_ohwx woman"
# sd-scripts' own list (train_util.py L104), not the worker's copy of it
SD_SCRIPTS_EXTENSIONS = [".png", ".jpg", ".jpeg", ".webp", ".bmp", ".PNG", ".JPG", ".JPEG", ".WEBP", ".BMP"]

raw_names = st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and b"\0" not in b
                                                       and b not in (b".", b".."))
stems = st.one_of(st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1,
                          max_size=20),
                  st.lists(st.sampled_from(["a", "b", "12", "x y"]), min_size=1, max_size=6).map("_".join),
                  raw_names.map(lambda b: os.fsdecode(b[:200])))
captions = st.one_of(st.text(max_size=60).map(str.encode), st.binary(max_size=60),
                     st.sampled_from([b"", b"\n", b"ohwx\x00woman", b"\xef\xbb\xbfohwx", b"a\x85b\nc", b"a\x0cb",
                                      b"\r\nohwx", b"ohwx\rwoman", "é".encode("latin-1"),
                                      b"x" * CAPTION_MAX_BYTES, b"x" * (CAPTION_MAX_BYTES + 1)]))
contents = st.one_of(st.just(png_bytes()), st.binary(max_size=32), st.just(b"\xff\xd8\xff\xe0"), st.just(b""))


@st.composite
def entries(draw) -> list[tuple[bytes, str, bytes]]:
    """(name, kind, content) of a kohya folder's entries: images with captions (or not), and anything else."""
    found: dict[bytes, tuple[str, bytes]] = {}
    for stem in draw(st.lists(stems, max_size=5)):
        ext = draw(st.sampled_from([".png", ".PNG", ".jpg", ".Jpg", ".gif", ".webp", ".txt", ""]))
        name = os.fsencode(stem + ext)[:255]
        if b"/" in name or name in (b".", b".."):
            continue
        found[name] = (draw(st.sampled_from(["file", "file", "file", "dir", "link", "fifo"])), draw(contents))
        if draw(st.booleans()):
            found[os.fsencode(os.path.splitext(stem + ext)[0] + ".txt")[:255]] = ("file", draw(captions))
    for name in draw(st.lists(raw_names, max_size=3)):
        found[name] = (draw(st.sampled_from(["file", "dir", "link"])), draw(contents | captions))
    return [(name, kind, content) for name, (kind, content) in found.items()]


def lay_out(folder: Path, items: list[tuple[bytes, str, bytes]]) -> None:
    base = os.fsencode(folder)
    for name, kind, content in items:
        path = base + b"/" + name
        if kind == "file":
            with open(path, "wb") as fh:
                fh.write(content)
        elif kind == "dir":
            os.mkdir(path)
        elif kind == "link":
            os.symlink(b"/etc/hostname", path)
        else:
            os.mkfifo(path)


def sd_scripts_caption(image_path: str) -> str | None:
    """train_util.py read_caption (caption_extension `.txt`, no wildcard), as sd-scripts runs it."""
    base_name = os.path.splitext(image_path)[0]
    tokens = base_name.split("_")
    face = "_".join(tokens[:-4]) if len(tokens) >= 5 else base_name
    for cap_path in (base_name + ".txt", face + ".txt"):
        if os.path.isfile(cap_path):
            with open(cap_path, encoding="utf-8") as f:
                lines = f.readlines()
            assert len(lines) > 0
            return lines[0].strip()
    return None


def sd_scripts_images(directory: str) -> set[str]:
    """train_util.py glob_images: what sd-scripts trains on in the folder."""
    paths: set[str] = set()
    for ext in SD_SCRIPTS_EXTENSIONS:
        paths.update(glob.glob(os.path.join(glob.escape(directory), "*" + ext)))
    return {os.path.basename(p) for p in paths}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("datasets")


@given(entries(), st.lists(raw_names, max_size=2))
@example([(b"img\xff.png", "file", png_bytes())], [])  # a 500 before issue #38: the manifest's hash could not encode it
@example([(b"img.png", "file", png_bytes()), (b"img.txt", "file", b"a\x85b\n")], [])  # \x85 ends no line for sd-scripts
@example([(b"im\ng.png", "file", png_bytes()), (b"im\ng.txt", "file", b"ohwx\x00woman")], [b"3_\xff"])
def test_any_folder_is_a_manifest_of_what_sd_scripts_reads_or_its_refusal(root, items, siblings):
    dataset = root / "dataset"
    shutil.rmtree(dataset, ignore_errors=True)
    (dataset / FOLDER).mkdir(parents=True)
    lay_out(dataset / FOLDER, items)
    for name in siblings:
        os.makedirs(os.fsencode(dataset) + b"/" + name, exist_ok=True)
    try:
        manifest = inspect_dataset(dataset, FOLDER)
    except DatasetInvalid as exc:
        assert exc.fields["dataset_dir"] and all(isinstance(m, str) and m.encode() for m in exc.fields["dataset_dir"])
        return
    manifest.sha256()
    folder = str(dataset / FOLDER)
    assert {image.name for image in manifest.images} == sd_scripts_images(folder)
    for image in manifest.images:
        assert image.caption == sd_scripts_caption(os.path.join(folder, image.name))
    assert not any(kohya.subset_repeats(os.fsdecode(name)) for name in siblings if os.fsdecode(name) != FOLDER)


@given(st.text(max_size=40) | raw_names.map(os.fsdecode))
def test_kohya_name_rules_answer_for_any_name(name):
    repeats = kohya.subset_repeats(name)
    assert repeats is None or repeats >= 1
    kohya.is_trained_image(name), kohya.skipped_image(name), kohya.caption_candidates(name)

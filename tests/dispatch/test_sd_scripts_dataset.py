"""Datasets as sd-scripts reads them: what it accepts is accepted, what it would misread is a 422 that says so,
and what it would silently skip is a warning (`file_skipped`) in the 202 that names it. Each rule is held to
sd-scripts' source at the pinned commit (kohya-ss/sd-scripts main 48d368fa, the same tree as the sd3 branch 3265f2ed
that fluxgym clones; docs/reference/sd-scripts.md). `TU` is library/train_util.py there."""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from PIL import Image

from lora_worker.dispatch.dataset import inspect_dataset
from tests.helpers import png_bytes

FOLDER = "10_ohwx woman"


def jpeg_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 80, 40)).save(out, "JPEG")
    return out.getvalue()


def folder(host) -> Path:
    return host.dataset / FOLDER


def refused(response, *says: str) -> str:
    body = response.get_json()
    assert response.status_code == 422, body
    message = " ".join([body.get("message", ""), *map(str, body.get("fields", {}).values())])
    for text in says:
        assert text in message, message
    return message


def test_a_png_named_upper_case_jpg_is_trained_on(api, host):
    """TU L104: IMAGE_EXTENSIONS holds ".JPG" beside ".jpg"; TU L2847-2856 glob_images globs each one, so
    `img9.JPG` is found. TU L2948-2951 load_image opens it with PIL's Image.open and TU L1478-1490 measures it
    with imagesize, both of which go by the file's content: a PNG named .JPG is read as the PNG it is."""
    (folder(host) / "img9.JPG").write_bytes(png_bytes())
    (folder(host) / "img9.txt").write_text("ohwx woman, upper case\n")
    manifest = inspect_dataset(host.dataset, FOLDER)
    assert "img9.JPG" in [i.name for i in manifest.images] and manifest.image_count == 4
    response = api.post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()


def test_a_jpeg_named_png_is_trained_on(api, host):
    """TU L2948-2951: PIL's Image.open reads the content whatever the name says."""
    (folder(host) / "img0.png").write_bytes(jpeg_bytes())
    assert api.post("/train", json=host.payload()).status_code == 202


@pytest.mark.parametrize("name", ["img9.Jpg", "img9.pNG", "img9.Webp"])
def test_an_image_in_mixed_case_would_be_skipped_so_it_is_a_warning(api, host, name):
    """TU L104 lists each extension in lower and in upper case only; TU L2851 `glob.glob(... base + ext)`, base
    "*", is case-sensitive on Linux, so `img9.Jpg` is never globbed: sd-scripts trains without it, silently."""
    (folder(host) / name).write_bytes(png_bytes())
    warned(api.post("/train", json=host.payload()), name, "would skip", "rename it to")


def warned(response, name: str, *says: str) -> None:
    """Accepted, with a `file_skipped` warning naming the file and saying why."""
    body = response.get_json()
    assert response.status_code == 202, body
    found = [w for w in body["warnings"] if w["code"] == "file_skipped" and w["file"] == f"{FOLDER}/{name}"]
    assert len(found) == 1, body["warnings"]
    for text in says:
        assert text in found[0]["message"], found[0]


@pytest.mark.parametrize("name, says", [("img9.gif", "does not read .gif"), ("img9.tiff", "does not read .tiff"),
                                        ("img9.avif", "Pillow plugin"), ("img9.jxl", "Pillow plugin")])
def test_image_formats_it_does_not_glob_are_warned_of_not_left_out_in_silence(api, host, name, says):
    """TU L104: no .gif or .tif(f) at all; TU L106-127: .avif and .jxl are globbed only when pillow_avif, jxlpy
    or pillow_jxl import in the trainer's venv, which the worker cannot see from here."""
    (folder(host) / name).write_bytes(b"whatever")
    warned(api.post("/train", json=host.payload()), name, says)


def test_a_dot_file_is_left_alone_as_sd_scripts_leaves_it(api, host):
    """TU L2851: glob's `*` never matches a leading dot, so macOS's `._img0.png` is not trained on; it is litter,
    not a refusal, and the warning says it is not trained on."""
    (folder(host) / "._img0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    warned(api.post("/train", json=host.payload()), "._img0.png", "dot-file")


def test_a_file_no_image_format_opens_is_refused(api, host):
    """TU L2948-2962: load_image raises on what PIL cannot open, after the job started."""
    (folder(host) / "img1.png").write_bytes(b"<html>not an image</html>")
    refused(api.post("/train", json=host.payload()), "img1.png", "not an image sd-scripts can open")


def test_a_face_crop_named_image_takes_the_caption_sd_scripts_takes(host):
    """TU L1946-1953 read_caption: the candidates are `<stem>.txt`, then, when the stem has 5 or more `_`
    tokens, the stem without its last four (`face_12_34_56_78` → `face.txt`); the first that exists is read."""
    (folder(host) / "face_12_34_56_78.png").write_bytes(png_bytes())
    (folder(host) / "face.txt").write_text("ohwx woman, from the face-crop caption\nsecond line unused\n")
    images = {i.name: i.caption for i in inspect_dataset(host.dataset, FOLDER).images}
    assert images["face_12_34_56_78.png"] == "ohwx woman, from the face-crop caption"
    (folder(host) / "face_12_34_56_78.txt").write_text("its own caption\n")
    images = {i.name: i.caption for i in inspect_dataset(host.dataset, FOLDER).images}
    assert images["face_12_34_56_78.png"] == "its own caption"


def test_an_empty_face_crop_caption_is_refused_as_sd_scripts_would_assert(api, host):
    """TU L1964: `assert len(lines) > 0` on the caption it picked, the face-crop one included."""
    (folder(host) / "face_12_34_56_78.png").write_bytes(png_bytes())
    (folder(host) / "face.txt").write_bytes(b"")
    refused(api.post("/train", json=host.payload()), "face.txt", "empty")


@pytest.mark.parametrize("dataset_dir, output_dir", [("./t1/dataset", "./t1/output"),
                                                     ("t1/./dataset", "t1//output/")])
def test_dot_components_are_normalised_not_refused(api, host, dataset_dir, output_dir):
    """sd-scripts is handed the worker's resolved real path (`--train_data_dir`), so `./t1/dataset` means what
    `t1/dataset` means; only `..` can climb, and it stays refused."""
    response = api.post("/train", json=host.payload(dataset_dir=dataset_dir, output_dir=output_dir))
    assert response.status_code == 202, response.get_json()
    job = api.get(f"/train/{response.get_json()['worker_job_id']}").get_json()
    root = Path(os.path.realpath(host.settings.train_root))
    assert (job["dataset_dir"], job["output_dir"]) == (str(root / "t1" / "dataset"), str(root / "t1" / "output"))
    refused(api.post("/train", json=host.payload(dataset_dir="./t1/../t1/dataset")), "'..'")


@pytest.mark.parametrize("name", ["ohwx.safetensors", "ohwx.SafeTensors"])
def test_an_output_name_with_the_suffix_is_refused_never_doubled(api, host, name):
    """TU L5781-5783 get_last_ckpt_name: `output_name + ext` with ext ".safetensors" (train_network.py L1726):
    `ohwx.safetensors` would be saved as `ohwx.safetensors.safetensors`."""
    message = refused(api.post("/train", json=host.payload(output_name=name)), "Without the .safetensors suffix",
                      f"{name}.safetensors")
    assert "'ohwx'" in message
    assert not list(host.settings.train_root.rglob("*.safetensors.safetensors"))

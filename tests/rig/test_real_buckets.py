"""Issue 34 on the REAL trainer: the bucket table a dry run predicts is the one sd-scripts prints, line for line, and
what the lint refuses is what the trainer dies of.

For each image set, `POST /train?dry_run=1` (the worker's own settings, pointed at the rig) answers a plan; the plan's
argv is run by the rig's accelerate (the dataset config it names written as a launch writes it), and read until
sd-scripts prints `mean ar error` at "make buckets", before it loads the model: then its process group is killed.
Seconds and little memory a set; still, the real trainer runs only under `flock /tmp/lw-rig.lock` (other engineers'
rig runs take ~21 GB). The truncated image is the one test here that loads the model (caching latents comes after
it): ~2 min and ~21 GB.

Opt-in: LW_RIG_DIR names a rig built by ../shared/rig/build.sh; without it every test here skips.
"""
from __future__ import annotations

import io
import os
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from lora_worker.config import Settings
from tests.helpers import fake_gpus, real_trainer
from tests.helpers.ledger import migrated_ledger

pytestmark = [pytest.mark.rig, pytest.mark.slow, pytest.mark.timeout(1800)]

RIG = os.environ.get("LW_RIG_DIR")
FOLDER = "3_ohwx dog"
TABLE_LINE = re.compile(r"^(bucket \d+: resolution \(\d+, \d+\), count: \d+|mean ar error \(without repeats\): .*)$",
                        re.MULTILINE)


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    """A small-to-write image of that size: a flat colour (so even 90 megapixels compress to little)."""
    rng = random.Random(seed)
    out = io.BytesIO()
    Image.new("RGB", (width, height), (rng.randrange(256), rng.randrange(256), rng.randrange(256))).save(out, fmt)
    return out.getvalue()


Layout = list[tuple[str, bytes]]


def mixed() -> Layout:
    sizes = [(1024, 1024), (1216, 832), (832, 1216), (2000, 1500), (3000, 1000), (640, 480), (1920, 1080),
             (777, 1333), (4000, 3000), (1080, 1920), (1500, 1500), (1024, 1536)]
    return [(f"m{i:02d}.{fmt.lower()}", image_bytes(w, h, fmt, i))
            for i, ((w, h), fmt) in enumerate(zip(sizes, ["PNG", "JPEG", "WEBP", "BMP"] * 3))]


def small() -> Layout:
    sizes = [(64, 64), (100, 300), (500, 400), (767, 767), (65, 1000), (300, 64), (128, 4000), (700, 200)]
    return [(f"s{i}.png", image_bytes(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]


def over_the_pixel_bound() -> Layout:
    """Two images past the 89,478,485 pixels the lint decodes (measured from their headers) among ordinary ones."""
    return [("big0.jpg", image_bytes(10000, 9000, "JPEG")), ("big1.png", image_bytes(9500, 9500, seed=1)),
            ("n0.jpg", image_bytes(1024, 768, "JPEG", 2)), ("n1.png", image_bytes(2048, 2048, seed=3))]


def at_resolution() -> Layout:
    sizes = [(768, 768), (1024, 1024), (768, 1024), (1024, 768), (768, 768), (704, 832), (832, 704)]
    return [(f"r{i}.png", image_bytes(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]


def odd_sizes() -> Layout:
    """150 odd sizes: past numpy's pairwise block (128), so the mean's summation order is held too."""
    rng = random.Random(34)
    sizes = [(rng.randrange(64, 3000) | 1, rng.randrange(64, 3000) | 1) for _ in range(150)]
    return [(f"o{i:03d}.png", image_bytes(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]


SETS: dict[str, tuple[Callable[[], Layout], str]] = {
    "mixed_1024": (mixed, "quality"), "mixed_768": (mixed, "fast"), "small_768": (small, "fast"),
    "over_the_pixel_bound_1024": (over_the_pixel_bound, "quality"), "at_resolution_768": (at_resolution, "fast"),
    "odd_sizes_1024": (odd_sizes, "quality"),
}


@pytest.fixture(scope="module")
def rig_api(tmp_path_factory: pytest.TempPathFactory):
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    rig, root = Path(RIG), tmp_path_factory.mktemp("rigbuckets")
    settings = Settings(
        state_dir=root / "state", train_root=root / "train", model_dirs=(rig / "models",),
        accelerate=rig / "venv/bin/accelerate", sd_scripts_dir=rig / "sd-scripts",
        tokenizer_cache_dir=rig / "tokenizers", cpu_threads=2, nvml_fake_file=fake_gpus(root / "gpus.json"),
        sandbox="none")
    migrated_ledger(settings.database_path)
    from lora_worker import create_app
    app = create_app(settings)
    app.config["TESTING"] = True
    yield rig, root, app.test_client()
    app.extensions["lora_worker"].db.dispose()


def dataset(root: Path, name: str, layout: Layout) -> Path:
    folder = root / "train" / name / "dataset" / FOLDER
    folder.mkdir(parents=True)
    for file, data in layout:
        (folder / file).write_bytes(data)
        (folder / (os.path.splitext(file)[0] + ".txt")).write_text("a photo of ohwx dog\n")
    return folder.parent


def body(rig: Path, data: Path, tier: str) -> dict:
    return {"dataset_dir": str(data), "base_model_path": str(rig / "models/sdxl_random.safetensors"),
            "output_dir": str(data.parent / "output"), "output_name": "ohwx", "trigger": "ohwx",
            "subject_class": "dog", "repeats": 3, "tier": tier, "device_index": 1, "seed": 42, "samples": []}


def written(plan: dict, replace: tuple[str, str] | None = None) -> list[str]:
    """The plan's argv, with the dataset config it names put in place as a launch would (a dry run writes none);
    `replace`: the config pointed at another dataset (a file of its own, named in the argv instead)."""
    config = plan["dataset"]["dataset_config"]
    path, toml = Path(config["path"]), config["toml"]
    if replace is not None:
        toml, path = toml.replace(*replace), path.with_name(f"replaced-{path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml)
    return [f"--dataset_config={path}" if a.startswith("--dataset_config=") else a for a in plan["argv"]]


def printed_table(rig: Path, argv: list[str], home: Path) -> tuple[list[str], real_trainer.Capture]:
    """Run the argv until sd-scripts has printed its bucket table (before the model load), then kill it."""
    cap = real_trainer.run(argv, rig / "sd-scripts", real_trainer.env(home), home,
                           kill_when=lambda out, err: "mean ar error" in out, timeout=300)
    return TABLE_LINE.findall(cap.text("stdout")), cap


@pytest.mark.parametrize("name", list(SETS))
def test_the_bucket_table_of_the_plan_is_the_one_the_real_trainer_prints(rig_api, name):
    rig, root, api = rig_api
    layout, tier = SETS[name]
    data = dataset(root, name, layout())
    answer = api.post("/train?dry_run=1", json=body(rig, data, tier))
    assert answer.status_code == 200, answer.get_json()
    plan = answer.get_json()
    predicted = plan["dataset"]["bucket_table"]["lines"]
    printed, cap = printed_table(rig, written(plan), data.parent)
    assert printed == predicted, cap.text("stdout")[-3000:]
    assert len(predicted) >= 2 and not (data.parent / "output").exists()
    if name.startswith("over_the_pixel_bound"):
        unverified = [w["file"] for w in plan["lint"]["warnings"] if w["code"] == "image_not_verified"]
        assert unverified == [f"{FOLDER}/big0.jpg", f"{FOLDER}/big1.png"]


@pytest.mark.parametrize("name, data, says", [
    ("edge_under_64", image_bytes(200, 40), "ZeroDivisionError"),
    ("size_unreadable", b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "ZeroDivisionError"),
])
def test_what_the_lint_refuses_at_make_buckets_is_what_the_real_trainer_dies_of_there(rig_api, name, data, says):
    """A 40 px high image has a bucket 0 px high (and an unreadable size is 0x0): sd-scripts divides by zero at
    "make buckets", before the model load; the lint refuses both, and the dry run says so."""
    rig, root, api = rig_api
    layout = [("a_ok.png", image_bytes(512, 512)), ("b_bad.png", data)]
    folder = dataset(root, name, layout)
    refused = api.post("/train?dry_run=1", json=body(rig, folder, "fast"))
    assert refused.status_code == 422
    codes = {f["code"] for f in refused.get_json()["details"]["findings"] if f["severity"] == "error"}
    assert codes == {"image_edge_under_64" if name == "edge_under_64" else "image_size_unreadable"}
    # the argv of a good set, pointed at this dataset
    good = dataset(root, f"{name}_ok", [("a_ok.png", image_bytes(512, 512))])
    argv = [a.replace(str(good), str(folder)) for a in
            written(api.post("/train?dry_run=1", json=body(rig, good, "fast")).get_json(), (str(good), str(folder)))]
    cap = real_trainer.run(argv, rig / "sd-scripts", real_trainer.env(folder.parent), folder.parent, timeout=300)
    assert cap.rc != 0 and says in cap.text("stderr") + cap.text("stdout")
    assert "loading model" not in cap.text("stdout").lower() and "make buckets" in cap.text("stdout")


def truncated_jpeg() -> bytes:
    whole = image_bytes(256, 256, "JPEG", 7)
    noisy = Image.effect_noise((256, 256), 64).convert("RGB")  # detail, so the cut lands in the scan data
    out = io.BytesIO()
    noisy.save(out, "JPEG", quality=95)
    data = out.getvalue()
    assert len(data) > 4 * len(whole)
    return data[: len(data) // 2]


def test_a_truncated_image_the_lint_refuses_is_one_the_real_trainer_dies_on_at_caching_latents(rig_api):
    """The one real run here that loads the model (~21 GB, 1-3 min, under the rig's flock): a JPEG cut in half is
    refused by the lint (`image_undecodable`), and the real trainer, given it, loads the model and then dies at
    `caching latents` with Pillow's `image file is truncated` (train_util.py L2948-2961)."""
    rig, root, api = rig_api
    folder = dataset(root, "truncated", [("a_cut.jpg", truncated_jpeg()), ("b_whole.png", image_bytes(256, 256))])
    refused = api.post("/train?dry_run=1", json=body(rig, folder, "fast"))
    assert refused.status_code == 422
    errors = [f for f in refused.get_json()["details"]["findings"] if f["severity"] == "error"]
    assert [(e["code"], e["file"]) for e in errors] == [("image_undecodable", f"{FOLDER}/a_cut.jpg")]
    assert "truncated" in errors[0]["message"]
    out = folder.parent / "out"
    # the worker's flags at the rig's size; fp32, as the rig README says for a CPU that emulates bf16 slowly
    argv = [a.replace("--mixed_precision=bf16", "--mixed_precision=no")
            for a in real_trainer.argv(rig, folder, out, steps=1)]
    cap = real_trainer.run(argv, rig / "sd-scripts", real_trainer.env(folder.parent), out, timeout=900)
    stdout, stderr = cap.text("stdout"), cap.text("stderr")
    assert cap.rc != 0 and cap.cancel is None, stdout[-2000:] + stderr[-2000:]
    assert "caching latents" in stdout and f"Error loading file: {folder / FOLDER / 'a_cut.jpg'}" in stdout + stderr
    assert "image file is truncated" in stderr
    assert not (out / "ohwx.safetensors").exists()

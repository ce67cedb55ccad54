"""How long a dry run (`POST /train?dry_run=1`) takes on a dataset of N photo-like JPEGs, and where the time goes.

Not one of `make bench`'s ratios: a figure for docs/jobs.md ("Dry run"), measured on demand.

    .venv/bin/python -m bench.dry_run --images 200 --size 1024 --tokenizers <a --tokenizer_cache_dir of CLIP's>

The images are blurred noise saved at JPEG quality 90 (about 130 KB each at 1024 px, as photos compress), each with a
caption; the service is the real app (Flask's test client) on a simulated trainer install whose tokenizers are
the real CLIP ones given (`--tokenizers`; the lint counts captions with them). It prints the dry run's wall time
(the median of `--repeats`, the page cache warm), the lint's own seconds, and a breakdown of the lint's work done
again piece by piece on the same files: read, sha256, Pillow's verify + load, the bucket arithmetic, the captions.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from PIL import Image, ImageFilter

from lora_worker import create_app
from lora_worker.dispatch.buckets import select_bucket
from lora_worker.host.clip_tokens import load_counter
from lora_worker.ledger.migrate import migrate
from tests.helpers import make_host

FOLDER = "10_ohwx woman"


def photo(size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    noise = Image.effect_noise((size, size), 80).convert("RGB")
    tint = Image.new("RGB", (size, size), (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    out = io.BytesIO()
    Image.blend(noise, tint, 0.5).filter(ImageFilter.GaussianBlur(2)).save(out, "JPEG", quality=90)
    return out.getvalue()


def dataset(folder: Path, images: int, size: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    for i in range(images):
        (folder / f"photo{i:04d}.jpg").write_bytes(photo(size, i))
        (folder / f"photo{i:04d}.txt").write_text(f"a photo of ohwx woman, portrait {i}, natural light, detailed\n")


def breakdown(folder: Path, size: int, tokenizers: Path) -> dict[str, float]:
    files = sorted(folder.glob("*.jpg"))
    took: dict[str, float] = {}
    t = time.perf_counter()
    blobs = [f.read_bytes() for f in files]
    took["read"] = time.perf_counter() - t
    t = time.perf_counter()
    for blob in blobs:
        hashlib.sha256(blob).hexdigest()
    took["sha256"] = time.perf_counter() - t
    t = time.perf_counter()
    for blob in blobs:
        with Image.open(io.BytesIO(blob)) as im:
            im.verify()
        with Image.open(io.BytesIO(blob)) as im:
            im.load()
    took["decode (verify + load)"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in blobs:
        select_bucket(size, size, 1024)
    took["buckets"] = time.perf_counter() - t
    counter = load_counter(tokenizers)
    t = time.perf_counter()
    for f in sorted(folder.glob("*.txt")):
        counter.count(f.read_text().splitlines()[0])
    took["captions"] = time.perf_counter() - t
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.dry_run", description=__doc__)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizers", type=Path, required=True)
    parser.add_argument("--plan", type=Path, default=None, help="write the last plan (JSON) here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        host = make_host(Path(tmp), tokenizers=args.tokenizers)
        migrate(host.settings)
        dataset(host.dataset / FOLDER, args.images, args.size)
        app = create_app(host.settings, launch=lambda job_id, settings: None)
        client = app.test_client()
        walls, plan = [], {}
        for _ in range(args.repeats):
            started = time.perf_counter()
            answer = client.post("/train?dry_run=1", json=host.payload(tier="quality", device_index=1))
            walls.append(time.perf_counter() - started)
            plan: dict[str, Any] = answer.get_json()
            if answer.status_code != 200:
                print(json.dumps(plan, indent=2), file=sys.stderr)
                return 1
        took = breakdown(host.dataset / FOLDER, args.size, args.tokenizers)
        app.extensions["lora_worker"].db.dispose()
    print(f"dry run of {args.images} JPEGs of {args.size} px: {statistics.median(walls):.2f} s wall (median of "
          f"{args.repeats}: {', '.join(f'{w:.2f}' for w in walls)}), the lint's own {plan['lint']['seconds']} s, "
          f"{plan['lint']['images_decoded']} decoded")
    for name, seconds in took.items():
        print(f"  {name:<24}{seconds:7.3f} s")
    if args.plan:
        args.plan.write_text(json.dumps(plan, indent=2, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

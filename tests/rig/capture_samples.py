"""Capture the REAL trainer's sample passes on the CPU rig (LW_RIG_DIR), for tests/data/rig/samples_*.jsonl:
`python -m tests.rig.capture_samples <work dir>`, under `flock /tmp/lw-rig.lock` (~21 GB of RAM, minutes).

The worker's argv shape at the rig's size (rank 4, 256 px, 3 images x 3 repeats, 6 steps) with step LoRAs and
states every 2 steps, every step LoRA kept, and the sample flags the worker adds: a JSON prompts file of two
prompts with fixed seeds at 256 px and 4 sampler steps, `--sample_every_n_steps=2 --sample_at_first
--sample_sampler=euler_a`. Written next to the capture: the sample folder's listing (name, size, the PNG's
IHDR width and height) and the sha256 of each LoRA's tensor bytes (the data after the header), which says
whether the last step's step LoRA holds the final LoRA's weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path

from tests.helpers import real_trainer

PROMPTS = [{"prompt": "photo of ohwx dog", "negative_prompt": "lowres, blurry", "width": 256, "height": 256,
            "seed": 42, "sample_steps": 4, "scale": 7.0},
           {"prompt": "ohwx dog on a beach", "negative_prompt": "lowres, blurry", "width": 256, "height": 256,
            "seed": 43, "sample_steps": 4, "scale": 7.0}]


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def tensor_sha(path: Path) -> str:
    with path.open("rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        fh.seek(8 + n)
        return hashlib.sha256(fh.read()).hexdigest()


def main(work: Path) -> int:
    rig = Path(os.environ["LW_RIG_DIR"])
    dataset = work / "dataset" / "3_ohwx dog"
    if dataset.exists():
        shutil.rmtree(work)
    shutil.copytree(rig / "data/img/2_ohwx dog", dataset)
    out = work / "out"
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    cmd = real_trainer.argv(rig, dataset.parent, out, steps=6, extra=(
        "--save_state", "--save_every_n_steps=2", "--save_last_n_steps_state=1", "--save_last_n_steps=5",
        f"--sample_prompts={prompts}", "--sample_every_n_steps=2", "--sample_at_first", "--sample_sampler=euler_a"))
    cap = real_trainer.run(cmd, rig / "sd-scripts", real_trainer.env(work), out, timeout=1800,
                           on_chunk=lambda t, s, text: print(f"[{t:8.1f} {s}] {text.rstrip()[:200]}", flush=True))
    rewrite = {str(out): "/worktank/arbo/train/t1/output/s1", str(dataset.parent): "/worktank/arbo/train/t1/dataset",
               str(prompts): "/var/lib/lora-worker/prompts/prompts.json", str(rig): "/opt/fluxgym",
               str(work): "/tmp/capture"}

    def rw(text: str) -> str:
        for old, new in rewrite.items():
            text = text.replace(old, new)
        return text
    (work / "samples_run.jsonl").write_text(cap.jsonl(rw))
    sample = out / "sample"
    listing = [{"name": p.name, "size": p.stat().st_size, "png": png_size(p)} for p in sorted(sample.iterdir())]
    loras = {p.name: tensor_sha(p) for p in sorted(out.glob("*.safetensors"))}
    (work / "samples_listing.json").write_text(json.dumps({"rc": cap.rc, "wall_s": cap.wall_s, "files": sorted(
        str(p.relative_to(out)) for p in out.rglob("*")), "sample": listing, "lora_tensor_sha256": loras}, indent=1))
    print(json.dumps({"rc": cap.rc, "wall_s": cap.wall_s, "sample": listing, "loras": loras}, indent=1))
    return 0 if cap.rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

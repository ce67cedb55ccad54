"""The fake trainer's sample images (`--sample_prompts`, `--sample_every_n_steps`, `--sample_at_first`), as
sd-scripts (48d368fa) draws them, without torch (train_util.py sample_images_common L6360-6491,
sample_image_inference L6493-6577):

- the gating: at step 0 only with --sample_at_first; otherwise only with an interval, --sample_every_n_epochs
  overriding --sample_every_n_steps, and a step pass only inside the loop (never at an epoch's end);
- the lines: an empty log line, `generating sample images at step / サンプル画像生成 ステップ: N`, a missing file's
  `No prompt file / プロンプトファイルがありません: …` (and no pass), then per prompt `prompt:`, `negative_prompt:`,
  `height:`, `width:`, `sample_steps:`, `scale:`, `sample_sampler:`, `seed:` (when set), and the pipeline's bar:
  tqdm, unnamed, leave=False, one update per sampler step;
- the prompts file: `.json` (a list of dicts used as they are, or of strings parsed as `.txt` lines), `.txt` (one
  prompt a line, ` --` options); any other extension raises UnboundLocalError at the first pass, as the real one;
- the sizes rounded down to a multiple of 8, at least 64; defaults 512 px, 30 steps, scale 7.5, no seed;
- each image a real PNG of its size (zlib and struct: the fake's interpreter may lack Pillow), named
  `<output_name>_<NUM>_<II>_<YYYYmmddHHMMSS>[_<seed>].png` in `<output_dir>/sample/`; no line says it was written;
- no try/except: an error in a pass ends the run (the step's save never comes). Modes: `sample_step_s` (a sampler
  step's sleep), `oom_in_sampling_at_step` (the CUDA OOM of a pass at that step, raised in sample_image_inference).

What the real trainer prints here is held to the rig's capture by tests/test_fake_rig.py.
"""
from __future__ import annotations

import json
import os
import re
import struct
import time
import zlib

from tqdm import tqdm


def due(args, epoch: int | None, steps: int) -> bool:
    """train_util.py L6380-6391."""
    if steps == 0:
        return bool(args.sample_at_first)
    if args.sample_every_n_steps is None and args.sample_every_n_epochs is None:
        return False
    if args.sample_every_n_epochs is not None:
        return epoch is not None and epoch % args.sample_every_n_epochs == 0
    return steps % args.sample_every_n_steps == 0 and epoch is None


def sample_images(log, args, epoch: int | None, steps: int, modes: dict, oom, phase) -> None:
    if not due(args, epoch, steps):
        return
    log("")
    log(f"generating sample images at step / サンプル画像生成 ステップ: {steps}")
    if not os.path.isfile(args.sample_prompts):
        log(f"No prompt file / プロンプトファイルがありません: {args.sample_prompts}")
        return
    prompts = read_prompts(args.sample_prompts)
    save_dir = args.output_dir + "/sample"
    os.makedirs(save_dir, exist_ok=True)
    phase("sampling")  # hang_in: a pass that never ends (its first image never drawn)
    for i, prompt in enumerate(prompts):
        entry = line_to_prompt_dict(prompt) if isinstance(prompt, str) else dict(prompt)
        entry["enum"] = i
        sample_image_inference(log, args, save_dir, entry, epoch, steps, modes, oom)


def read_prompts(path: str) -> list:
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        prompts = [line.strip() for line in lines if len(line.strip()) > 0 and line[0] != "#"]
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            prompts = json.load(f)
    return prompts  # noqa: F821 - another extension: UnboundLocalError, as the real trainer raises


OPTIONS = {"w": ("width", int), "h": ("height", int), "d": ("seed", int), "s": ("sample_steps", int),
           "l": ("scale", float), "n": ("negative_prompt", str), "ss": ("sample_sampler", str)}


def line_to_prompt_dict(line: str) -> dict:
    parts = line.split(" --")
    entry: dict = {"prompt": parts[0]}
    for part in parts[1:]:
        m = re.match(r"(ss|[whdsln]) (.+)", part.strip(), re.IGNORECASE)
        if m:
            key, cast = OPTIONS[m[1].lower()]
            entry[key] = cast(m[2]) if cast is not int else int(re.match(r"\d+", m[2])[0])
    return entry


def sample_image_inference(log, args, save_dir: str, entry: dict, epoch: int | None, steps: int, modes: dict,
                           oom) -> None:
    sample_steps = entry.get("sample_steps", 30)
    width, height = entry.get("width", 512), entry.get("height", 512)
    seed = entry.get("seed")
    sampler = entry.get("sample_sampler", args.sample_sampler)
    height = max(64, height - height % 8)
    width = max(64, width - width % 8)
    log(f"prompt: {entry.get('prompt', '')}")
    log(f"negative_prompt: {entry.get('negative_prompt')}")
    log(f"height: {height}")
    log(f"width: {width}")
    log(f"sample_steps: {sample_steps}")
    log(f"scale: {entry.get('scale', 7.5)}")
    log(f"sample_sampler: {sampler}")
    if seed is not None:
        log(f"seed: {seed}")
    for _ in tqdm(range(sample_steps), leave=False):
        time.sleep(float(modes.get("sample_step_s", 0.001)))
        if steps == modes.get("oom_in_sampling_at_step"):
            raise oom("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 23.57 GiB of "
                      "which 1.06 GiB is free. Including non-PyTorch memory, this process has 22.50 GiB memory in use.")
    ts_str = time.strftime("%Y%m%d%H%M%S", time.localtime())
    num_suffix = f"e{epoch:06d}" if epoch is not None else f"{steps:06d}"
    seed_suffix = "" if seed is None else f"_{seed}"
    prefix = "" if args.output_name is None else args.output_name + "_"
    name = f"{prefix}{num_suffix}_{entry['enum']:02d}_{ts_str}{seed_suffix}.png"
    write_png(os.path.join(save_dir, name), width, height, (steps * 37 + (seed or 0)) % 256)


def write_png(path: str, width: int, height: int, tone: int) -> None:
    """An 8-bit RGB PNG of a gradient (each row filter 0), laid out as Pillow's writer lays out the real ones
    (tests/data/rig/sample-step4-prompt0.png): IHDR, the data in IDAT chunks of 64 KiB, IEND, each CRC'd."""
    row = b"\x00" + b"".join(bytes((x * 255 // max(1, width - 1), tone, (x + tone) % 256)) for x in range(width))
    raw = row * height

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    data = zlib.compress(raw, 6)
    with open(path, "wb") as fh:
        fh.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                 + b"".join(chunk(b"IDAT", data[i:i + 65536]) for i in range(0, len(data), 65536))
                 + chunk(b"IEND", b""))

"""A host without a GPU or sd-scripts, made to look like the real one: the simulated trainer (the test double
in tests/fakes/), a pair of simulated GPUs, a tiny SDXL checkpoint and a kohya dataset.

`make demo` builds it; it is the same trainer the tests run, installed the same way. The launcher's first
line names this interpreter, not `python3` from PATH: the worker hands the trainer a restricted PATH, on
which `/usr/bin/env python3` finds the system Python, without tqdm.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lora_worker.config import REPO_ROOT
from lora_worker.host import kohya

FAKES = REPO_ROOT / "tests" / "fakes"
DATA = REPO_ROOT / "tests" / "data"  # the real captures and headers the fake is held to
LAUNCHER = "accelerate"
TOKENIZER_DIRS = ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")
TTS_NAME = "tts_server (simulated)"  # what tts_process_pattern matches on the 24 GB card
TTS_COMM = "tts_server"
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}  # the dtypes of the real checkpoint's tensors

# The real headers the fake works from (tests/data, copied next to it): the LoRA it writes is that run's, and the
# checkpoint it loads must hold that checkpoint's every tensor, as sd-scripts' loader wants them.
REAL_HEADERS = ("lora-header-run1_simple.json", "sdxl-checkpoint-header.json")


def install_simulated_trainer(root: Path, python: str = sys.executable,
                              tokenizers: Path | None = None) -> dict[str, Path]:
    """Lay out a trainer install shaped like fluxgym's under `root`: venv/bin/accelerate, sd-scripts/, tokenizers/.

    Returns the three settings that point the worker at it. Safe to run again over an earlier install.
    `tokenizers`: a tokenizer cache laid out already, named instead of writing one (3.8 MB; the test suite
    shares one among the hosts of a process)."""
    if not (FAKES / LAUNCHER).is_file():
        raise FileNotFoundError(f"the simulated trainer is not in this checkout: {FAKES} is missing")
    venv_bin = root / "venv" / "bin"
    venv_bin.mkdir(parents=True, exist_ok=True)
    launcher = venv_bin / LAUNCHER
    body = (FAKES / LAUNCHER).read_text().split("\n", 1)[1]
    launcher.write_text(f"#!{python}\n{body}")
    launcher.chmod(0o755)
    sd_scripts = root / "sd-scripts"
    sd_scripts.mkdir(exist_ok=True)
    for source in sorted(FAKES.iterdir()):  # every file of the fake: the trainer script and what it reads
        if source.is_file() and source.name != LAUNCHER:
            shutil.copy(source, sd_scripts / source.name)
    for name in REAL_HEADERS:
        shutil.copy(DATA / name, sd_scripts / name)
    if tokenizers is None:
        tokenizers = write_tokenizer_cache(root / "tokenizers")
    return {"accelerate": launcher, "sd_scripts_dir": sd_scripts, "tokenizer_cache_dir": tokenizers}


@functools.cache
def clip_tokenizer_files() -> dict[str, bytes]:
    """Files shaped like a CLIP BPE tokenizer's: 49408 tokens, the `#version` line and 48894 merges, and
    model_max_length 77. Generated, not copied: the real ones are 1.5 MB and carry nothing the fake reads."""
    vocab = {f"tok{i}</w>": i for i in range(49408)}
    merges = "#version: 0.2\n" + "".join(f"t{i} ok{i}</w>\n" for i in range(48894))
    config = {"model_max_length": 77, "tokenizer_class": "CLIPTokenizer", "pad_token": "<|endoftext|>"}
    return {"vocab.json": json.dumps(vocab).encode(), "merges.txt": merges.encode(),
            "tokenizer_config.json": json.dumps(config).encode()}


def write_tokenizer_cache(folder: Path) -> Path:
    """Both SDXL tokenizers, shaped as an offline install's `--tokenizer_cache_dir` (the preflight checks them)."""
    for name in TOKENIZER_DIRS:
        write_tokenizer(folder / name)
    return folder


def write_tokenizer(folder: Path, **overrides: bytes | None) -> Path:
    """A tokenizer folder; `overrides` replaces a file's bytes by name, e.g. `vocab_json=b"{}"` (None: left out)."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes | None] = dict(clip_tokenizer_files())
    for key, data in overrides.items():
        files[key.replace("_json", ".json").replace("_txt", ".txt")] = data
    for name, data in files.items():
        if data is not None:
            (folder / name).write_bytes(data)
    return folder


def sdxl_checkpoint_tensors() -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the real SDXL checkpoint the sd-scripts captures loaded (tests/data), dtype and shape."""
    doc = json.loads((DATA / "sdxl-checkpoint-header.json").read_text())
    return {name: (info["dtype"], info["shape"]) for name, info in doc["tensors"].items()}


def set_trainer_modes(sd_scripts_dir: Path, **modes: Any) -> None:
    """The fake's knobs (`step_s`, `load_s`, …), read from its working directory, the sd-scripts dir."""
    (sd_scripts_dir / "fake_trainer.json").write_text(json.dumps(modes))


def start_tts_stand_in(preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
    """A sleeping process named like a TTS server: the foreign compute process on the 24 GB card."""
    # Its name (what /gpu-status and a 409 gpu_busy show) is set the way a real server's is: in /proc/self/comm.
    code = f"open('/proc/self/comm', 'w').write({TTS_COMM!r})\nimport time\nwhile True: time.sleep(3600)"
    return subprocess.Popen([TTS_NAME, "-c", code],  # noqa: S603
                            executable=sys.executable, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=preexec_fn)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; returns once it is reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_gpus(path: Path, tts_pid: int | None) -> Path:
    """The `nvml_fake_file`: a 24 GB card at bus 01 running TTS (6 GiB), and an idle 48 GB card at bus 02."""
    tts = [{"pid": tts_pid, "used_mib": 6_144}] if tts_pid else []
    doc = {"devices": [
        {"name": "NVIDIA GeForce RTX 3090 (simulated)", "uuid": "GPU-SIMULATED-3090", "pci_bus_id": "00000000:01:00.0",
         "memory_total_mib": 24_576, "memory_used_mib": 6_400, "utilization_pct": 31, "temperature_c": 52,
         "processes": tts},
        {"name": "NVIDIA RTX A6000 (simulated)", "uuid": "GPU-SIMULATED-A6000", "pci_bus_id": "00000000:02:00.0",
         "memory_total_mib": 49_140, "memory_used_mib": 310, "utilization_pct": 0, "temperature_c": 34,
         "processes": []},
    ]}
    path.write_text(json.dumps(doc, indent=2))
    return path


def write_base_model(path: Path) -> Path:
    """A single-file SDXL checkpoint with every tensor of a real one that the real safetensors loader opens
    (see `write_sparse_safetensors`); the worker's preflight reads the header only, the fake never loads weights."""
    return write_sparse_safetensors(path, sdxl_checkpoint_tensors(),
                                    {"note": "simulated SDXL checkpoint: no weights"})


def write_sparse_safetensors(path: Path, tensors: Mapping[str, tuple[str, list[int]]],
                             metadata: dict[str, str] | None = None, *, truncate_by: int = 0) -> Path:
    """A safetensors file the real loader opens: each tensor's offsets span its dtype size × shape, end to end, to
    the end of the file. The data is a hole (the file is truncated to size, never written), so a full SDXL header
    makes a 6.9 GB file that costs ~200 KB of disk. `truncate_by` cuts that many bytes off its end (a broken file,
    for tests)."""
    return write_sparse_layout(path, sparse_safetensors_layout(tensors, metadata), truncate_by=truncate_by)


def sparse_safetensors_layout(tensors: Mapping[str, tuple[str, list[int]]],
                              metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    """Such a file's first bytes (the header's length and the header) and the length of the data after them:
    built once, a layout is written again in microseconds (the tests write the SDXL one for every host)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = DTYPE_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def write_sparse_layout(path: Path, layout: tuple[bytes, int], *, truncate_by: int = 0) -> Path:
    head, data_bytes = layout
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + data_bytes - truncate_by)
    return path


def write_dataset(train_dir: Path, trigger: str, subject_class: str, repeats: int, images: int) -> Path:
    """`<train_dir>/dataset/<repeats>_<trigger> <class>/imgN.png` + captions; returns the dataset dir."""
    dataset = train_dir / "dataset"
    folder = dataset / kohya.folder_name(repeats, trigger, subject_class)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(images):
        (folder / f"img{i}.png").write_bytes(_png(64, 64, shade=40 + 30 * i))
        (folder / f"img{i}.txt").write_text(f"{trigger} {subject_class}, portrait, photo {i + 1}\n")
    return dataset


def make_shared_dir(path: Path) -> None:
    """The train root as the deployed host has it: setgid and group-writable, closed to others."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o2770)


def _png(width: int, height: int, shade: int) -> bytes:
    """A real greyscale PNG: a diagonal gradient."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + bytes((shade + x + y) % 256 for x in range(width)) for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))

"""Builders for what the tests need on disk: a fake trainer installation, datasets, models, fake GPUs."""
from __future__ import annotations

import functools
import importlib.util
import json
import sqlite3
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lora_worker.config import Settings
# One installer for the demo and the tests; the tokenizer builders are re-exported for the tests' own cases.
from lora_worker.ops.simulated import clip_tokenizer_files, install_simulated_trainer, sdxl_checkpoint_tensors  # noqa: F401
from lora_worker.ops.simulated import sparse_safetensors_layout, write_sparse_layout, write_sparse_safetensors
from lora_worker.ops.simulated import write_tokenizer, write_tokenizer_cache  # noqa: F401

TESTS = Path(__file__).parent.parent
FAKES = TESTS / "fakes"
DATA = TESTS / "data"
TOKENIZER_DIRS = ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}
TRAINER_VERSIONS = {"torch": "2.7.0", "accelerate": "1.6.0", "diffusers": "0.32.1", "transformers": "4.54.1",
                    "bitsandbytes": "0.50.2"}
SD_SCRIPTS_COMMIT = "3265f2ed0000000000000000000000000000beef"


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None = None,
                      *, truncate_by: int = 0) -> None:
    """A well-formed safetensors file (zero data, written sparse) with the given tensor names, dtypes and shapes:
    what the real loader opens. The demo's simulated checkpoint is written by the same function."""
    if tensors is SDXL_TINY and metadata is None:  # every host's base model: its 2514-tensor header built once
        write_sparse_layout(path, _sdxl_tiny_layout(), truncate_by=truncate_by)
    else:
        write_sparse_safetensors(path, tensors, metadata, truncate_by=truncate_by)


# The full SDXL key set (2514 tensors), written sparse: what the preflight and the real loader accept.
SDXL_TINY = sdxl_checkpoint_tensors()


@functools.cache
def _sdxl_tiny_layout() -> tuple[bytes, int]:
    return sparse_safetensors_layout(SDXL_TINY)


def png_bytes(width: int = 64, height: int = 64) -> bytes:
    """A real (grey) PNG image, 64 px: an edge under 64 px is one the trainer divides by zero on (the lint refuses
    it)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\0" + b"\x80" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def make_dataset(train_root: Path, train_id: str = "t1", folder: str = "10_ohwx woman", images: int = 3,
                 captions: dict[int, bytes] | None = None) -> Path:
    """`<root>/<train_id>/dataset/<folder>/img<i>.png` (+ captions); returns the dataset dir."""
    dataset = train_root / train_id / "dataset"
    target = dataset / folder
    target.mkdir(parents=True, exist_ok=True)
    for i in range(images):
        (target / f"img{i}.png").write_bytes(png_bytes())
    for i, text in (captions if captions is not None else {i: b"ohwx woman, portrait" for i in range(images)}).items():
        (target / f"img{i}.txt").write_bytes(text)
    return dataset


def install_fake_trainer(root: Path, tokenizers: Path | None = None) -> dict[str, Path]:
    """A trainer installation shaped like fluxgym's (the demo's simulated one: venv/bin/accelerate, sd-scripts/,
    tokenizers/), plus what the fingerprint reads: package metadata in the venv and the checkout's HEAD.
    `tokenizers`: an existing tokenizer cache to name instead of writing one (`shared_tokenizers`)."""
    install = install_simulated_trainer(root, tokenizers=tokenizers)
    site = root / "venv" / "lib" / "python3.11" / "site-packages"
    for name, version in TRAINER_VERSIONS.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    git = install["sd_scripts_dir"] / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/sd3\n")
    (git / "refs" / "heads" / "sd3").write_text(SD_SCRIPTS_COMMIT + "\n")
    return install


def fake_gpus(path: Path, *, free0: int = 20_000, free1: int = 40_000, processes0: list[dict] | None = None,
              processes1: list[dict] | None = None, **extra: Any) -> Path:
    """Two GPUs like the documented host: a 24 GB card at bus 01 and a 48 GB card at bus 02."""
    doc = {"devices": [
        {"name": "NVIDIA GeForce RTX 3090", "uuid": "GPU-3090", "pci_bus_id": "00000000:01:00.0",
         "memory_total_mib": 24_576, "memory_used_mib": 24_576 - free0, "utilization_pct": 3, "temperature_c": 41,
         "processes": processes0 or []},
        {"name": "NVIDIA RTX A6000", "uuid": "GPU-A6000", "pci_bus_id": "00000000:02:00.0",
         "memory_total_mib": 49_140, "memory_used_mib": 49_140 - free1, "utilization_pct": 0, "temperature_c": 35,
         "processes": processes1 or []},
    ], **extra}
    path.write_text(json.dumps(doc))
    return path


def set_modes(sd_scripts_dir: Path, **modes: Any) -> None:
    (sd_scripts_dir / "fake_trainer.json").write_text(json.dumps(modes))


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


def hold_exclusive(path: Path, seconds: float) -> threading.Thread:
    """Another connection takes the write lock and sits on it."""
    ready = threading.Event()

    def hold() -> None:
        conn = sqlite3.connect(path, isolation_level=None, timeout=30)
        conn.execute("BEGIN EXCLUSIVE")
        ready.set()
        time.sleep(seconds)
        conn.execute("ROLLBACK")
        conn.close()

    thread = threading.Thread(target=hold)
    thread.start()
    ready.wait(30)
    return thread


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def payload(dataset: Path, model: Path, **overrides: Any) -> dict[str, Any]:
    body = {
        "dataset_dir": str(dataset),
        "base_model_path": str(model),
        "output_dir": str(dataset.parent / "output"),
        "output_name": "ohwx_lora",
        "trigger": "ohwx",
        "subject_class": "woman",
        "repeats": 10,
        "tier": "fast",
        "device_index": 1,
        "seed": 42,
    }
    body.update(overrides)
    return body


class Launches(list):
    """Stands in for the supervisor launcher: records job ids, starts nothing."""

    def __call__(self, job_id: int, settings: object) -> None:
        self.append(job_id)


def job_rows(settings: Any) -> int:
    conn = sqlite3.connect(settings.database_path)
    try:
        return conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
    finally:
        conn.close()


def install_script() -> ModuleType:
    """systemd/install.py as a module (it is a script, outside the package)."""
    spec = importlib.util.spec_from_file_location("lora_worker_install", TESTS.parent / "systemd"
                                                  / "install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is being made
    spec.loader.exec_module(module)
    return module


@dataclass
class Host:
    """Everything a test's (or a benchmark's) worker host has on disk."""

    root: Path
    settings: Settings
    dataset: Path
    model: Path

    @property
    def sd_scripts(self) -> Path:
        return self.settings.sd_scripts_dir

    @property
    def gpus(self) -> Path:
        assert self.settings.nvml_fake_file is not None
        return self.settings.nvml_fake_file

    def payload(self, **overrides: object) -> dict:
        return payload(self.dataset, self.model, **overrides)


def make_host(root: Path, *, tokenizers: Path | None = None, **settings: Any) -> Host:
    """A fake trainer install, a base model, a dataset and fake GPUs under `root`, and settings naming them.

    The defaults make supervision quick for tests (progress every 0.1 s, a 1 s cancel grace); `settings`
    overrides them (the benchmarks run with the production intervals). `tokenizers`: a tokenizer cache to name
    instead of writing one under `root` (the `host` fixture's, shared by a process's hosts)."""
    install = install_fake_trainer(root / "opt", tokenizers)
    model = root / "models" / "sdxl_tiny.safetensors"
    write_safetensors(model, SDXL_TINY)
    train_root = root / "train"
    dataset = make_dataset(train_root)
    values: dict[str, Any] = {
        "state_dir": root / "state", "train_root": train_root, "model_dirs": (root / "models",),
        "nvml_fake_file": fake_gpus(root / "gpus.json"), "progress_interval_s": 0.1, "cancel_grace_s": 1.0,
        "launch_grace_s": 2.0,
        # Explicitly without the sandbox: these tests read the trainer's host pids and record files outside its
        # paths. tests/host/test_sandbox.py runs jobs with sandbox = "bwrap".
        "sandbox": "none", **install, **settings,
    }
    return Host(root=root, settings=Settings(**values), dataset=dataset, model=model)


def shared_tokenizers(folder: Path) -> Path:
    """The tokenizer cache the `host` fixture's hosts share: 3.8 MB written once per process instead of per test
    (the bulk of what a host writes). `tokenizer_identities` tells whether a test changed it."""
    return write_tokenizer_cache(folder)


def tokenizer_identities(folder: Path) -> list[tuple[str, int, int, int, int]]:
    """Each path under `folder` with its inode, size and times: any write, removal or replacement changes it."""
    found = []
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        found.append((str(path.relative_to(folder)), info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return found

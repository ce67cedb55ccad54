"""Is the sd-scripts installation complete and usable? Checked before each dispatch and by `lora-worker doctor`.

The tokenizers are checked for shape, not just presence: sd-scripts loads them from `--tokenizer_cache_dir`
with transformers' CLIPTokenizer, which accepts a `{}` vocab.json, an empty merges.txt or a missing
tokenizer_config.json without a word. The trainer then loads the whole model (21 GB, ~30 s) and dies caching
text-encoder outputs with `OverflowError: cannot fit 'int' into an index-sized integer` (a missing config makes
`model_max_length` 10^30; fail_tokenizer_hollow.log in tests/data). What the SDXL text encoders need, from
sdxl_model_util's CLIPTextConfig (vocab_size=49408, max_position_embeddings=77) and CLIP's BPE:
- vocab.json: a JSON object of 49408 tokens;
- merges.txt: a `#version` first line, then the 48894 merges the tokenizer reads (49408 - 2 x 256 byte
  tokens - 2 special tokens; transformers slices exactly that many, so more lines are harmless, fewer are not);
- tokenizer_config.json: `model_max_length` 77.
"""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lora_worker.config import Settings
from lora_worker.errors import TrainerUnavailable

# The folder names strategy_base._load_tokenizer looks for inside --tokenizer_cache_dir.
TOKENIZER_DIRS = ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")
CLIP_VOCAB_SIZE = 49408
CLIP_MERGES = CLIP_VOCAB_SIZE - 2 * 256 - 2
CLIP_MAX_LENGTH = 77
MAX_TOKENIZER_FILE_BYTES = 8 * 1024 * 1024  # the real files are 0.5-1.7 MB; anything far larger is not one


class FileUnusable(Exception):
    """A tokenizer file that is missing, not a regular file, too large, or not what CLIP needs."""


def missing_trainer_parts(settings: Settings) -> list[str]:
    """One phrase per problem, each naming its path; empty when the trainer can run offline."""
    missing = []
    if not (settings.accelerate.is_file() and os.access(settings.accelerate, os.X_OK)):
        missing.append(f"accelerate launcher {settings.accelerate}")
    if not settings.train_script.is_file():
        missing.append(f"training script {settings.train_script}")
    for name in TOKENIZER_DIRS:
        missing.extend(tokenizer_problems(settings.tokenizer_cache_dir / name))
    return missing


def require_trainer(settings: Settings) -> None:
    missing = missing_trainer_parts(settings)
    if missing:
        raise TrainerUnavailable("The trainer installation is incomplete or broken: " + "; ".join(missing) + ".",
                                 missing=missing)


def tokenizer_problems(folder: Path) -> list[str]:
    """What is wrong with one tokenizer folder, a phrase per file, each naming the file."""
    problems = []
    for name, check in FILE_CHECKS.items():
        path = folder / name
        try:
            check_file(path, check)
        except FileUnusable as exc:
            problems.append(f"tokenizer file {path}: {exc}")
    return problems


# The files that passed a check, by identity: the check parses ~1 MB of JSON per vocab.json, 16 ms of every
# dispatch's preflight for files that never change. A file changed in any way since (written, replaced, renamed
# over, truncated) has another inode or ctime, which no user can set back, so it is read and checked again.
# Only passes are kept; a refusal is checked afresh each time.
_PASSED: dict[tuple[int, int, int, int, int], Callable[[bytes], None]] = {}
_PASSED_MAX = 64


def check_file(path: Path, check: Callable[[bytes], None]) -> None:
    """Run `check` on the bytes of the regular file at `path` (at most MAX_TOKENIZER_FILE_BYTES), unless that very
    file passed it already. O_NONBLOCK: a FIFO put in its place cannot hang the request (open returns at once,
    and fstat then refuses it)."""
    fd = _open_nonblocking(path)
    try:
        info = os.fstat(fd)
        identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        if _PASSED.get(identity) is check:
            return
        check(_read_regular(fd, info))
        if len(_PASSED) >= _PASSED_MAX:
            _PASSED.clear()
        _PASSED[identity] = check
    except OSError as exc:
        raise FileUnusable(f"cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)


def read_checked(path: Path, check: Callable[[bytes], None]) -> bytes:
    """The bytes of a tokenizer file, checked as the preflight checks it (FileUnusable names what fails)."""
    try:
        fd = _open_nonblocking(path)
        try:
            data = _read_regular(fd, os.fstat(fd))
        finally:
            os.close(fd)
        check(data)
    except FileUnusable as exc:
        raise FileUnusable(f"tokenizer file {path}: {exc}") from exc
    except OSError as exc:
        raise FileUnusable(f"tokenizer file {path}: cannot be read ({exc.strerror or exc})") from exc
    return data


def _open_nonblocking(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileUnusable("missing") from None
    except OSError as exc:
        raise FileUnusable(f"cannot be opened ({exc.strerror or exc})") from exc


def _read_regular(fd: int, info: os.stat_result, limit: int = MAX_TOKENIZER_FILE_BYTES) -> bytes:
    if not stat.S_ISREG(info.st_mode):
        raise FileUnusable("not a regular file")
    if info.st_size > limit:
        raise FileUnusable(f"{info.st_size} bytes, more than a tokenizer file ever has ({limit})")
    chunks, size = [], 0
    while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise FileUnusable(f"grew past {limit} bytes while being read")
    return b"".join(chunks)


def check_vocab(data: bytes) -> None:
    vocab = _json_object(data)
    if len(vocab) != CLIP_VOCAB_SIZE:
        raise FileUnusable(f"{len(vocab)} tokens; CLIP's vocabulary has {CLIP_VOCAB_SIZE}")
    if not all(type(v) is int for v in vocab.values()):
        raise FileUnusable("token ids must be integers")


def check_merges(data: bytes) -> None:
    lines = _text(data).strip().split("\n")
    if not lines[0].startswith("#version"):
        raise FileUnusable("does not start with the '#version' line")
    merges = len(lines) - 1
    if merges < CLIP_MERGES:
        raise FileUnusable(f"{merges} merges; CLIP's BPE reads {CLIP_MERGES}")


def check_tokenizer_config(data: bytes) -> None:
    length = _json_object(data).get("model_max_length")
    if length != CLIP_MAX_LENGTH or type(length) is not int:
        raise FileUnusable(f"model_max_length is {length!r}; the SDXL text encoders take {CLIP_MAX_LENGTH} tokens")


FILE_CHECKS: dict[str, Callable[[bytes], None]] = {
    "vocab.json": check_vocab,
    "merges.txt": check_merges,
    "tokenizer_config.json": check_tokenizer_config,
}


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileUnusable(f"not UTF-8 ({exc.reason} at byte {exc.start})") from exc


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(_text(data))
    except json.JSONDecodeError as exc:
        raise FileUnusable(f"not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(value, dict):
        raise FileUnusable("not a JSON object")
    return value


# The trainer's environment, key by key (an allow-list: no token, LD_PRELOAD or PYTHONPATH leaks in).
ENV_KEYS: tuple[str, ...] = (
    "PATH", "HOME", "LANG", "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED",
    "PYTHONIOENCODING", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "HF_HOME", "COLUMNS",
)


def trainer_env(settings: Settings, cuda_visible_devices: str | None) -> dict[str, str]:
    """A job's whole environment for these devices (also the trainer probe's, so it tests what a job gets), in
    ENV_KEYS' order; without CUDA_VISIBLE_DEVICES where `cuda_visible_devices` is None (a Slurm node sets it)."""
    env = {
        "PATH": settings.child_path,
        "HOME": str(settings.state_dir),
        "LANG": "C.UTF-8",
        # CUDA numbers devices by speed unless told otherwise; PCI order matches NVML and nvidia-smi.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": cuda_visible_devices,
        # Without it the `epoch`/`saving checkpoint` prints arrive late, block-buffered.
        "PYTHONUNBUFFERED": "1",
        "PYTHONIOENCODING": "utf-8",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        # A worker-owned HF_HOME also means no stray accelerate default_config.yaml is read.
        "HF_HOME": str(settings.hf_home_dir),
        "COLUMNS": "250",
    }
    return {key: value for key, value in env.items() if value is not None}

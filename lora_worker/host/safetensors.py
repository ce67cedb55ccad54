"""Reading safetensors headers without torch: the base model's (its key set is judged in dispatch/model.py), and
the LoRA we produced.

Format: 8 bytes little-endian header length N, then N bytes of JSON (`{name: {dtype, shape, data_offsets}}`
plus an optional `__metadata__` of strings), then the tensor bytes, fully indexed with no holes.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors reference implementation enforces


class HeaderError(ValueError):
    """The file is not a complete, well-formed safetensors file."""


@dataclass(frozen=True)
class Header:
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    file_size: int


@dataclass(frozen=True)
class LoraInfo:
    """What a LoRA file says about itself."""

    ranks: frozenset[int]
    families: frozenset[str]  # e.g. {"lora_unet"}
    metadata: dict[str, str] = field(default_factory=dict)
    file_size: int = 0


def read_header(path: Path) -> Header:
    """Parse and check the header; a truncated file (killed mid-save) fails the size check."""
    with path.open("rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(0)
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{path.name}: shorter than 8 bytes")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise HeaderError(f"{path.name}: header length {length} does not fit a {size}-byte file")
        raw = fh.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"{path.name}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise HeaderError(f"{path.name}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError(f"{path.name}: __metadata__ must map names to strings")
    _check_offsets(path, header, size - 8 - length)
    return Header(tensors=header, metadata=metadata, file_size=size)


def _check_offsets(path: Path, tensors: dict[str, Any], data_bytes: int) -> None:
    end = 0
    for name, info in tensors.items():
        try:
            begin, stop = info["data_offsets"]
            shape = info["shape"]
            info["dtype"]
        except (KeyError, TypeError, ValueError) as exc:
            raise HeaderError(f"{path.name}: tensor {name!r} has a malformed entry") from exc
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise HeaderError(f"{path.name}: tensor {name!r} has a malformed shape")
        if not all(type(o) is int for o in (begin, stop)) or not 0 <= begin <= stop <= data_bytes:
            raise HeaderError(f"{path.name}: tensor {name!r} lies outside the file")
        end = max(end, stop)
    if end != data_bytes:
        raise HeaderError(f"{path.name}: {data_bytes} data bytes but tensors index {end} (truncated or padded)")


def inspect_lora(path: Path) -> LoraInfo:
    header = read_header(path)
    ranks: set[int] = set()
    families: set[str] = set()
    modules = 0
    for name, info in header.tensors.items():
        if name.endswith(".lora_down.weight"):
            if not info["shape"]:
                raise HeaderError(f"{path.name}: tensor {name!r} has no shape; a lora_down weight has a rank")
            modules += 1
            ranks.add(int(info["shape"][0]))
            families.add(name.split("_", 2)[0] + "_" + name.split("_", 2)[1])
    if modules == 0:
        raise HeaderError(f"{path.name}: no lora_down weights; not a LoRA")
    return LoraInfo(ranks=frozenset(ranks), families=frozenset(families),
                    metadata=header.metadata, file_size=header.file_size)


@dataclass(frozen=True)
class ExpectedLora:
    """What the request and the tier say the final LoRA must be."""

    rank: int
    output_name: str
    max_train_steps: int
    seed: int
    not_before: float = 0.0  # the file must be newer than the run (epoch seconds)


@dataclass(frozen=True)
class ArtifactCheck:
    """What was found at `<output_dir>/<output_name>.safetensors`."""

    path: str
    problem: str | None = None  # None: present and verified
    mismatch: bool = False  # readable, but not the LoRA that was asked for
    missing: bool = False
    size: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)


def verify_lora(path: Path, expected: ExpectedLora) -> ArtifactCheck:
    """Read the LoRA's header (never its tensors) and compare it with the request."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return ArtifactCheck(str(path), problem="file not found", missing=True)
    if stat.st_mtime < expected.not_before:
        return ArtifactCheck(str(path), problem="the file predates this run", missing=True)
    try:
        info = inspect_lora(path)
    except (OSError, HeaderError) as exc:
        return ArtifactCheck(str(path), problem=str(exc))
    md = info.metadata
    checks = [
        ("lora_unet" in info.families, f"no U-Net LoRA modules (families: {sorted(info.families)})"),
        (info.ranks == {expected.rank}, f"rank {sorted(info.ranks)} instead of {expected.rank}"),
        (md.get("ss_network_dim") == str(expected.rank),
         f"ss_network_dim {md.get('ss_network_dim')!r} instead of {expected.rank}"),
        (md.get("ss_output_name") == expected.output_name,
         f"ss_output_name {md.get('ss_output_name')!r} instead of {expected.output_name!r}"),
        (md.get("ss_max_train_steps", md.get("ss_steps")) == str(expected.max_train_steps),
         f"ss_max_train_steps {md.get('ss_max_train_steps')!r} instead of {expected.max_train_steps}"),
        (md.get("ss_seed") == str(expected.seed), f"ss_seed {md.get('ss_seed')!r} instead of {expected.seed}"),
    ]
    problems = [message for ok, message in checks if not ok]
    if problems:
        return ArtifactCheck(str(path), problem="; ".join(problems), mismatch=True, size=info.file_size)
    return ArtifactCheck(str(path), size=info.file_size, metadata=md)


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()

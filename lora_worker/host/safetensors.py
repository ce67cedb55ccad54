"""Reading safetensors headers without torch: the base model's (its key set is judged in dispatch/model.py), and
the LoRA we produced. The header's format and its checks are host/safetensors_header.py's (re-exported here).

The LoRA lies in the train root, which a hostile party shares: every file here is opened as a regular file at
the path itself (a symbolic link there is refused, not followed, and a FIFO cannot block the open).
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from lora_worker.host import fs
from lora_worker.host.safetensors_header import (DTYPE_BITS, MAX_HEADER_BYTES, Header, HeaderError, quoted, shorten,
                                                 parse_header)

__all__ = ["DTYPE_BITS", "MAX_HEADER_BYTES", "ArtifactCheck", "ExpectedLora", "Header", "HeaderError", "LoraInfo",
           "dtype_problem", "inspect_lora", "lora_info", "parse_header", "read_header", "verify_lora"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraInfo:
    """What a LoRA file says about itself."""

    ranks: frozenset[int]
    families: frozenset[str]  # e.g. {"lora_unet"}
    metadata: dict[str, str] = field(default_factory=dict)
    file_size: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> how many LoRA tensors have it


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file itself; OSError for a link, FIFO or device (as for
    a missing file, so every caller that handles one handles the others)."""
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, _ = fs.open_regular(parent, path.name)
    finally:
        os.close(parent)
    return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file


def read_header(path: Path) -> Header:
    """Parse and check the header; a truncated file (killed mid-save) fails the size check."""
    with open_regular(path) as fh:
        return parse_header(fh, path.name)


def inspect_lora(path: Path) -> LoraInfo:
    return lora_info(read_header(path), path.name)


def lora_info(header: Header, name: str) -> LoraInfo:
    """What a parsed header says about the LoRA; HeaderError if it holds no LoRA weights."""
    ranks: set[int] = set()
    families: set[str] = set()
    modules = 0
    for tensor, info in header.tensors.items():
        if tensor.endswith(".lora_down.weight"):
            if not info["shape"]:
                raise HeaderError(f"{name}: tensor {quoted(tensor)} has no shape; a lora_down weight has a rank")
            modules += 1
            ranks.add(int(info["shape"][0]))
            families.add(tensor.split("_", 2)[0] + "_" + tensor.split("_", 2)[1])
    if modules == 0:
        raise HeaderError(f"{name}: no lora_down weights; not a LoRA")
    return LoraInfo(ranks=frozenset(ranks), families=frozenset(families),
                    metadata=header.metadata, file_size=header.file_size, dtypes=lora_dtypes(header))


LORA_TENSOR_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".alpha")


def lora_dtypes(header: Header) -> dict[str, int]:
    """How many of the LoRA's tensors (down, up, alpha) each dtype holds: sd-scripts casts all of them to
    --save_precision, so a file it wrote has exactly one."""
    counts: dict[str, int] = {}
    for name, info in header.tensors.items():
        if name.endswith(LORA_TENSOR_SUFFIXES):
            counts[str(info["dtype"])] = counts.get(str(info["dtype"]), 0) + 1
    return counts


def dtype_problem(dtypes: dict[str, int], expected: str) -> str | None:
    """Why a LoRA's tensors are not all of the `expected` dtype, or None when they are."""
    wrong = {dtype: n for dtype, n in sorted(dtypes.items()) if dtype != expected}
    if not wrong:
        return None
    found = ", ".join(f"{n} {dtype}" for dtype, n in wrong.items())
    return f"tensors of another dtype than {expected} ({found})"


@dataclass(frozen=True)
class ExpectedLora:
    """What the final LoRA must be, and where: worked out once at dispatch from the request and its tier,
    recorded in the job's row, and read back from the row by the supervisor that checks the file.

    There is no "newer than the run" time test: a wall clock that steps back during a run would fail a good
    one. Freshness comes from identity instead: nothing was at the path when the job was accepted nor right
    before the trainer started (dispatch and the pre-exec check refuse otherwise), the output directory is
    the one recorded then (`output_dir_id`), and the file has no other hard link."""

    rank: int  # the shape[0] of every lora_down weight, and ss_network_dim
    output_name: str  # ss_output_name
    steps: int  # ss_max_train_steps
    seed: int  # ss_seed
    dtype: str  # of every saved LoRA tensor, as safetensors names it ("F32", "F16", "BF16")
    output_dir_id: fs.FileId | None = None  # the output directory's identity as dispatch recorded it
    # ss_steps of the final LoRA: sd-scripts writes the global_step it ended at, so a run (a resumed one
    # included) that trained more or fewer steps than asked, or numbered them wrongly, is caught here.
    trained_steps: int | None = None


@dataclass(frozen=True)
class ArtifactCheck:
    """What was found at `<output_dir>/<output_name>.safetensors`."""

    path: str
    problem: str | None = None  # None: present and verified
    mismatch: bool = False  # readable, but not the LoRA that was asked for
    missing: bool = False
    size: int | None = None
    sha256: str | None = None  # of the very file whose header was checked
    metadata: dict[str, str] = field(default_factory=dict)


def verify_lora(path: Path, expected: ExpectedLora) -> ArtifactCheck:
    """Open the LoRA as a hostile party may have left it, then read its header (never its tensors into
    memory) and hash it, both from the one open file, and compare the header with the request.

    Whatever the file holds, the answer is an ArtifactCheck: a supervisor checks a step LoRA inside its loop,
    and a file the checks did not foresee is that file's problem, never the run's (tests/host/test_safetensors_fuzz.py
    holds parse_header to its one refusal; this is the net under it)."""
    try:
        return _verify_lora(path, expected)
    except Exception as exc:  # noqa: BLE001 - the net: recorded as the file's problem, with its traceback logged
        log.exception("%s: the LoRA check failed", path)
        return ArtifactCheck(str(path), problem=f"{path.name} could not be checked ({type(exc).__name__}: "
                                                f"{shorten(str(exc))})")


def _verify_lora(path: Path, expected: ExpectedLora) -> ArtifactCheck:
    where = str(path)
    opened = _open_artifact(path, expected)
    if isinstance(opened, ArtifactCheck):
        return opened
    fd, st = opened
    with os.fdopen(fd, "rb") as fh:
        if st.st_nlink != 1:
            return ArtifactCheck(where, problem=f"{path.name} has {st.st_nlink} hard links; "
                                                "the LoRA must be a file of its own")
        real = fs.real_path_of(fd)
        if real != where:
            return ArtifactCheck(where, problem=f"{path.name} is really {real}")
        try:
            info = lora_info(parse_header(fh, path.name), path.name)
            digest = _sha256(fh)
        except (OSError, HeaderError) as exc:
            return ArtifactCheck(where, problem=str(exc))
    if problems := _differences(info, expected):
        return ArtifactCheck(where, problem="; ".join(problems), mismatch=True, size=info.file_size)
    return ArtifactCheck(where, size=info.file_size, sha256=digest, metadata=info.metadata)


def _open_artifact(path: Path, expected: ExpectedLora) -> tuple[int, os.stat_result] | ArtifactCheck:
    """The LoRA's open descriptor and its fstat, or why there is none. The output directory is walked without
    following links and must still be the recorded one; the file is opened with O_NOFOLLOW|O_NONBLOCK (a link
    is refused, a FIFO opens at once and is refused by fstat) and must be a regular file."""
    where = str(path)
    try:
        dir_fd = fs.open_dir(str(path.parent))
    except FileNotFoundError:
        return ArtifactCheck(where, problem="the output directory is gone", missing=True)
    except OSError as exc:
        return ArtifactCheck(where, problem=f"the output directory cannot be opened without following links: {exc}")
    try:
        if expected.output_dir_id is not None and fs.FileId.of(os.fstat(dir_fd)) != expected.output_dir_id:
            return ArtifactCheck(where, problem="the output directory was replaced during the run")
        try:
            return fs.open_regular(dir_fd, path.name)
        except FileNotFoundError:
            return ArtifactCheck(where, problem="file not found", missing=True)
        except OSError as exc:
            return ArtifactCheck(where, problem=str(exc))
    finally:
        os.close(dir_fd)


def _differences(info: LoraInfo, expected: ExpectedLora) -> list[str]:
    """How the LoRA differs from the one that was asked for (empty: it is that one)."""
    md = info.metadata
    checks = [
        ("lora_unet" in info.families, f"no U-Net LoRA modules (families: {shorten(str(sorted(info.families)))})"),
        (info.ranks == {expected.rank}, f"rank {sorted(info.ranks)} instead of {expected.rank}"),
        (md.get("ss_network_dim") == str(expected.rank),
         f"ss_network_dim {quoted(md.get('ss_network_dim'))} instead of {expected.rank}"),
        (md.get("ss_output_name") == expected.output_name,
         f"ss_output_name {quoted(md.get('ss_output_name'))} instead of {expected.output_name!r}"),
        (md.get("ss_max_train_steps", md.get("ss_steps")) == str(expected.steps),
         f"ss_max_train_steps {quoted(md.get('ss_max_train_steps'))} instead of {expected.steps}"),
        (md.get("ss_seed") == str(expected.seed), f"ss_seed {quoted(md.get('ss_seed'))} instead of {expected.seed}"),
    ]
    problems = [message for ok, message in checks if not ok]
    if expected.trained_steps is not None and md.get("ss_steps") != str(expected.trained_steps):
        problems.append(f"ss_steps {quoted(md.get('ss_steps'))} instead of {expected.trained_steps}")
    if wrong := dtype_problem(info.dtypes, expected.dtype):
        problems.append(wrong)
    return problems


def _sha256(fh: BinaryIO, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    fh.seek(0)
    while block := fh.read(chunk):
        digest.update(block)
    return digest.hexdigest()


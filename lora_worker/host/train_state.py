"""The trainer's saved states in a job's output directory, checked without torch and without following a link.

sd-scripts (`--save_state` with `--save_every_n_steps`) has accelerate write `<output_name>-step<8 digits>-state/`
(train_util.py STEP_STATE_NAME, `save_and_remove_state_stepwise`); accelerate 1.6 `save_accelerator_state`
writes into it the network's weights (`model.safetensors`), the optimizer and scheduler (`optimizer.bin`,
`scheduler.bin`) and the RNG states (`random_states_0.pkl`), all three `torch.save` zip archives, plus
`scaler.pt` under fp16 only; sd-scripts' save hook adds `train_state.json` (`{"current_epoch", "current_step"}`,
train_network.py L943-948). A resume loads every one of them (`accelerator.load_state`), so every one is checked:

- each is a regular file itself (a link, FIFO or directory is refused, never followed or opened blocking);
- `train_state.json` is small JSON with integer `current_step` and `current_epoch`;
- `model.safetensors` has a complete safetensors header (host/safetensors.py) of LoRA weights of the rank the
  job trains;
- each zip's members are read whole and their CRC-32 checked, as `torch.load` would read them: a state cut short
  by a power cut fails here. Bounded: at most MAX_ARCHIVE_BYTES of members per state and MAX_CHECK_S of time;
  a state past either is not verified, so not used.
"""
from __future__ import annotations

import json
import lzma
import os
import re
import struct
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_worker.host import fs
from lora_worker.host.safetensors import HeaderError, lora_info, parse_header

STATE_DIR = re.compile(r"^(?P<name>.+)-step(?P<step>[0-9]{8})-state$")  # `%08d`: ASCII digits, not any \d
MODEL = "model.safetensors"
TRAIN_STATE = "train_state.json"
ARCHIVES = ("optimizer.bin", "scheduler.bin", "random_states_0.pkl")
OPTIONAL_ARCHIVES = ("scaler.pt",)  # fp16 mixed precision only (a GradScaler)
REQUIRED = (MODEL, TRAIN_STATE, *ARCHIVES)
MAX_TRAIN_STATE_BYTES = 4096
# A state is ~257 MB at dim 16 and ~513 MB at dim 32 (AdamW8bit): 4 GiB of members and 120 s (at a slow
# disk's 50 MB/s, 6 GB) leave room for both, and bound what a planted archive can make a request read.
MAX_ARCHIVE_BYTES = 4 << 30
MAX_CHECK_S = 120.0
CHUNK = 1 << 20
# What zipfile raises on bytes that are not an intact archive, beyond its BadZipFile: a member flagged encrypted
# (RuntimeError) or compressed by a method it lacks (NotImplementedError), a deflate, bzip2 or LZMA stream that
# does not decode (zlib.error, OSError, LZMAError), a record cut short (EOFError, struct.error), an offset past
# what a seek takes (OverflowError, ValueError). A power cut or a flipped bit gives any of them; each is the
# archive's refusal, `state_archive_corrupt` (tests/host/test_train_state_fuzz.py flips bits in real archives).
ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, NotImplementedError, zlib.error,
              lzma.LZMAError, struct.error, OverflowError)


@dataclass(frozen=True)
class Problem:
    code: str  # a resume reason (errors.RESUME_REASONS)
    message: str


@dataclass
class StateCheck:
    """What one state directory is: its step (from its name), train_state.json's values, and what is wrong."""

    name: str
    step: int
    current_step: int | None = None
    current_epoch: int | None = None
    problems: list[Problem] = field(default_factory=list)

    def refuse(self, code: str, message: str) -> None:
        self.problems.append(Problem(code, f"{self.name}: {message}"))


def state_name(output_name: str, step: int) -> str:
    return f"{output_name}-step{step:08d}-state"


def find_states(output_dir: str, output_name: str) -> list[tuple[str, int]]:
    """The step-state directories' names and steps, newest first; OSError if the output dir cannot be opened
    without following a link. Anything of the right name is listed, whatever it is: the check says what."""
    dir_fd = fs.open_dir(output_dir)
    try:
        found = []
        for name, _ in fs.list_entries(dir_fd):
            m = STATE_DIR.match(name)
            if m is not None and m["name"] == output_name:
                found.append((name, int(m["step"])))
        return sorted(found, key=lambda e: -e[1])
    finally:
        os.close(dir_fd)


def check_state(output_dir: str, name: str, *, rank: int, clock: Callable[[], float] = time.monotonic) -> StateCheck:
    """Every check of one state directory (its name from `find_states`) that needs only its files."""
    m = STATE_DIR.match(name)
    check = StateCheck(name, int(m["step"]) if m else -1)
    try:
        parent = fs.open_dir(output_dir)
    except OSError as exc:
        check.refuse("state_file_invalid", f"the output directory cannot be opened: {exc}")
        return check
    try:
        try:
            dir_fd = fs.open_subdir(parent, name)
        except OSError as exc:
            check.refuse("state_file_invalid", str(exc))
            return check
        try:
            _check_files(dir_fd, check, rank, clock)
        finally:
            os.close(dir_fd)
    finally:
        os.close(parent)
    return check


def _check_files(dir_fd: int, check: StateCheck, rank: int, clock: Callable[[], float]) -> None:
    entries = dict(fs.list_entries(dir_fd))
    for name in sorted(set(REQUIRED) - entries.keys()):
        check.refuse("state_incomplete", f"{name} is missing")
    for name, st in entries.items():
        if not _is_regular(st):
            check.refuse("state_file_invalid", f"{name} is a {fs.kind_of(st.st_mode)}, not a regular file")
    if check.problems:
        return
    _check_train_state(dir_fd, check)
    _check_model(dir_fd, check, rank)
    budget = _Budget(clock() + MAX_CHECK_S, MAX_ARCHIVE_BYTES, clock)
    for name in (*ARCHIVES, *(a for a in OPTIONAL_ARCHIVES if a in entries)):
        if check.problems:
            break  # refused already: the rest of its bytes need not be read
        _check_archive(dir_fd, name, check, budget)


def _is_regular(st: os.stat_result) -> bool:
    return fs.kind_of(st.st_mode) == "regular file"


def _check_train_state(dir_fd: int, check: StateCheck) -> None:
    try:
        fd, _ = fs.open_regular(dir_fd, TRAIN_STATE)
        try:
            data = json.loads(fs.read_capped(fd, MAX_TRAIN_STATE_BYTES))
        finally:
            os.close(fd)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: 4 KB of `[` nest past the stack
        check.refuse("state_json_invalid", f"{TRAIN_STATE} cannot be read as JSON: {type(exc).__name__}: {exc}")
        return
    step = data.get("current_step") if isinstance(data, dict) else None
    epoch = data.get("current_epoch") if isinstance(data, dict) else None
    if type(step) is not int or type(epoch) is not int:
        check.refuse("state_json_invalid", f"{TRAIN_STATE} has no integer current_step and current_epoch")
        return
    check.current_step, check.current_epoch = step, epoch
    if step != check.step:
        check.refuse("state_step_mismatch", f"{TRAIN_STATE} says step {step}, its directory's name step {check.step}")


def _check_model(dir_fd: int, check: StateCheck, rank: int) -> None:
    try:
        fd, _ = fs.open_regular(dir_fd, MODEL)
        with os.fdopen(fd, "rb") as fh:
            info = lora_info(parse_header(fh, MODEL), MODEL)
    except (OSError, HeaderError) as exc:
        check.refuse("state_model_invalid", f"{MODEL} fails the LoRA header check: {exc}")
        return
    if info.ranks != {rank}:
        check.refuse("state_model_invalid", f"{MODEL} holds rank {sorted(info.ranks)}, the job trains rank {rank}")


@dataclass
class _Budget:
    deadline: float
    bytes_left: int
    clock: Callable[[], float]


def _check_archive(dir_fd: int, name: str, check: StateCheck, budget: _Budget) -> None:
    """Read every member of the zip to its end: zipfile checks each one's CRC-32 there (BadZipFile if wrong)."""
    try:
        fd, _ = fs.open_regular(dir_fd, name)
        with os.fdopen(fd, "rb") as fh, zipfile.ZipFile(fh) as archive:
            members = archive.infolist()
            declared = sum(m.file_size for m in members)
            if not members or declared > budget.bytes_left:
                why = "no members" if not members else f"more than {MAX_ARCHIVE_BYTES} bytes of members in all"
                check.refuse("state_unverifiable" if members else "state_archive_corrupt", f"{name} has {why}")
                return
            budget.bytes_left -= declared
            for member in members:
                with archive.open(member) as stream:
                    while stream.read(CHUNK):
                        if budget.clock() > budget.deadline:
                            check.refuse("state_unverifiable", f"{name} was not read whole within {MAX_CHECK_S:.0f} s")
                            return
    except ZIP_ERRORS as exc:
        check.refuse("state_archive_corrupt", f"{name} is not an intact zip archive: {type(exc).__name__}: {exc}")


def remove_states(output_dir: str, output_name: str) -> list[str]:
    """After a verified success: the job's state directories (`<name>-step<N>-state`, and `<name>-state` that
    sd-scripts saves at the end) are removed; nothing is left to resume, and each is hundreds of MB. Walked
    without following a link: a link is unlinked, never followed; a directory nested in a state (the trainer
    writes none) is left, and so is the state holding it. The names removed."""
    removed = []
    dir_fd = fs.open_dir(output_dir)
    try:
        for name, st in fs.list_entries(dir_fd):
            m = STATE_DIR.match(name)
            ours = (m is not None and m["name"] == output_name) or name == f"{output_name}-state"
            if ours and fs.kind_of(st.st_mode) == "directory" and _remove_flat_dir(dir_fd, name):
                removed.append(name)
    finally:
        os.close(dir_fd)
    return removed


def _remove_flat_dir(parent_fd: int, name: str) -> bool:
    try:
        fd = fs.open_subdir(parent_fd, name)
    except OSError:
        return False
    try:
        for entry, st in fs.list_entries(fd):
            if fs.kind_of(st.st_mode) == "directory":
                return False
            os.unlink(entry, dir_fd=fd)  # a link itself, never what it points to
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)
    return True

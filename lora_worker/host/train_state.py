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
  by a power cut fails here. Bounded: at most MAX_ARCHIVE_BYTES of members and MAX_CHECK_S of time for all the
  states one verdict looks at (`Budget`); a state past either is not verified, so not used.

The cheap checks come first (names, kinds and sizes by `stat`, `train_state.json`, the model's header, each
archive's central directory), the CRCs last and only for a state that passed everything else (dispatch/
resumable.py asks for them after the ledger's rows, the step arithmetic and the fingerprint); an archive that
passed is remembered by its identity (device, inode, size, mtime, ctime), so asking again reads nothing.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from lora_worker.host import fs, state_archives
from lora_worker.host.safetensors import HeaderError, lora_info, parse_header
from lora_worker.host.state_archives import Budget


STATE_DIR = re.compile(r"^(?P<name>.+)-step(?P<step>[0-9]{8})-state$")  # `%08d`: ASCII digits, not any \d
MODEL = "model.safetensors"
TRAIN_STATE = "train_state.json"
ARCHIVES = ("optimizer.bin", "scheduler.bin", "random_states_0.pkl")
OPTIONAL_ARCHIVES = ("scaler.pt",)  # fp16 mixed precision only (a GradScaler)
REQUIRED = (MODEL, TRAIN_STATE, *ARCHIVES)
MAX_TRAIN_STATE_BYTES = 4096


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


def check_state(output_dir: str, name: str, *, rank: int, clock: Callable[[], float] = time.monotonic,
                archives: bool = True, budget: Budget | None = None) -> StateCheck:
    """Every check of one state directory (its name from `find_states`) that needs only its files, the cheap ones
    first: which files, their kinds and sizes, `train_state.json`, the model's header, each archive's directory;
    then (`archives`) every archive member read through its CRC, within `budget` (one per verdict: a request
    that looks at several states reads at most MAX_ARCHIVE_BYTES in MAX_CHECK_S in all)."""
    check = StateCheck(name, _step_of(name))
    with _opened(output_dir, name, check) as dir_fd:
        if dir_fd is not None:
            _check_files(dir_fd, check, rank)
            if archives and not check.problems:
                _check_archives(dir_fd, check, budget or Budget.start(clock))
    return check


def check_archives(output_dir: str, name: str, budget: Budget) -> StateCheck:
    """The costly part alone, for a state whose cheap checks passed: every archive member's CRC."""
    check = StateCheck(name, _step_of(name))
    with _opened(output_dir, name, check) as dir_fd:
        if dir_fd is not None:
            _check_archives(dir_fd, check, budget)
    return check


def _step_of(name: str) -> int:
    m = STATE_DIR.match(name)
    return int(m["step"]) if m else -1


@contextmanager
def _opened(output_dir: str, name: str, check: StateCheck) -> Iterator[int | None]:
    """The state directory, opened without following a link (None, and the check refused, when it cannot be)."""
    try:
        parent = fs.open_dir(output_dir)
    except OSError as exc:
        check.refuse("state_file_invalid", f"the output directory cannot be opened: {exc}")
        yield None
        return
    try:
        try:
            dir_fd = fs.open_subdir(parent, name)
        except OSError as exc:
            check.refuse("state_file_invalid", str(exc))
            yield None
            return
        try:
            yield dir_fd
        finally:
            os.close(dir_fd)
    finally:
        os.close(parent)


def _check_files(dir_fd: int, check: StateCheck, rank: int) -> None:
    entries = dict(fs.list_entries(dir_fd))
    for name in sorted(set(REQUIRED) - entries.keys()):
        check.refuse("state_incomplete", f"{name} is missing")
    for name, st in entries.items():
        if not _is_regular(st):
            check.refuse("state_file_invalid", f"{name} is a {fs.kind_of(st.st_mode)}, not a regular file")
    if check.problems:
        return
    _check_sizes(entries, check)
    if check.problems:
        return
    _check_train_state(dir_fd, check)
    _check_model(dir_fd, check, rank)
    for name in _archives_of(entries):
        if check.problems:
            break
        _check_directory(dir_fd, name, check)


def _archives_of(entries: dict[str, os.stat_result]) -> list[str]:
    return [*ARCHIVES, *(a for a in OPTIONAL_ARCHIVES if a in entries)]


def _check_sizes(entries: dict[str, os.stat_result], check: StateCheck) -> None:
    """By their sizes alone (a stat, nothing read): the archives together past what a verdict may read are not
    verified; an empty file is no state."""
    archives, most = sum(entries[name].st_size for name in _archives_of(entries)), state_archives.MAX_ARCHIVE_BYTES
    if archives > most:
        check.refuse("state_unverifiable", f"its archives hold {archives} bytes: more than {most} bytes, what a "
                     "check reads at most")
    for name in sorted(REQUIRED):
        if entries[name].st_size == 0:
            check.refuse("state_incomplete", f"{name} is empty")


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


def _check_directory(dir_fd: int, name: str, check: StateCheck) -> None:
    """The archive's central directory alone (at its end), as a request may parse it."""
    try:
        fd, _ = fs.open_regular(dir_fd, name)
        with os.fdopen(fd, "rb") as fh:
            state_archives.members(fh, name)
    except state_archives.Refusal as exc:
        check.refuse(exc.code, exc.message)
    except state_archives.UNREADABLE as exc:
        check.refuse("state_archive_corrupt", f"{name} is not an intact zip archive: {type(exc).__name__}: {exc}")


def _check_archives(dir_fd: int, check: StateCheck, budget: Budget) -> None:
    for name in _archives_of(dict(fs.list_entries(dir_fd))):
        if check.problems:
            break  # refused already: the rest of its bytes need not be read
        if (refused := state_archives.read_through(dir_fd, name, budget)) is not None:
            check.refuse(refused.code, refused.message)


def remove_states(output_dir: str, output_name: str, expected: str | None = None, *,
                  dry_run: bool = False) -> list[str]:
    """The job's state directories (`<name>-step<N>-state`, and `<name>-state` that sd-scripts saves at the end), once
    they can serve no resume: after a verified success, a client's cancel, a failure no resume can follow, or by
    retention. Each is hundreds of MB. Walked without following a link: a link is unlinked, never followed; a
    directory nested in a state (the trainer writes none) is left, and so is the state holding it. `expected`: the
    output directory's recorded identity (`dev:ino`), else nothing is removed (it was swapped for another). The
    names removed (with `dry_run`, the names that would be)."""
    removed = []
    dir_fd = fs.open_dir(output_dir)
    try:
        if expected is not None and str(fs.FileId.of(os.fstat(dir_fd))) != expected:
            return []
        for name, st in fs.list_entries(dir_fd):
            m = STATE_DIR.match(name)
            ours = (m is not None and m["name"] == output_name) or name == f"{output_name}-state"
            if ours and fs.kind_of(st.st_mode) == "directory" and (dry_run or _remove_flat_dir(dir_fd, name)):
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

"""`lora-worker doctor`: the host checks behind dispatch, one line each, for an operator at a terminal."""
from __future__ import annotations

import grp
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from lora_worker.config import Settings
from lora_worker.errors import LoraWorkerError, NvmlUnavailable
from lora_worker.host.nvml import Nvml
from lora_worker.ledger.migrate import current_revision, head_revision, verify_integrity
from lora_worker.host import sandbox
from lora_worker.host.trainer import missing_trainer_parts


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True  # a failed optional check is a warning, not a failure

    def line(self) -> str:
        mark = "ok" if self.ok else ("FAIL" if self.required else "warn")
        return f"[{mark:>4}] {self.name}: {self.detail}"


def run_checks(settings: Settings, nvml: Nvml) -> list[Check]:
    return [*_gpu_checks(settings, nvml), *_trainer_checks(settings), *_disk_checks(settings)]


def _gpu_checks(settings: Settings, nvml: Nvml) -> Iterator[Check]:
    try:
        readings = nvml.read()
    except NvmlUnavailable as exc:
        yield Check("nvml", False, exc.message)
        return
    yield Check("nvml", True, f"{len(readings)} device(s), PCI bus order")
    by_index = {r.index: r for r in readings}
    for index, profile in sorted(settings.devices.items()):
        reading = by_index.get(index)
        if reading is None:
            yield Check(f"device {index} ({profile.label})", False, "configured but not present")
        elif reading.error:
            yield Check(f"device {index} ({profile.label})", False, f"unreadable: {reading.error}")
        else:
            yield Check(f"device {index} ({profile.label})", True,
                        f"{reading.name}, {reading.pci_bus_id}, {reading.memory_free_mib}/{reading.memory_total_mib}"
                        f" MiB free, {len(reading.processes)} compute process(es), tiers {sorted(profile.tiers)}")


def _trainer_checks(settings: Settings) -> Iterator[Check]:
    missing = missing_trainer_parts(settings)
    problem = sandbox.probe(settings)
    yield Check("sandbox", problem is None, sandbox.describe(settings) + (f"; {problem}" if problem else ""))
    yield Check("trainer", not missing, "accelerate, sdxl_train_network.py and both CLIP tokenizers present"
                if not missing else "missing " + "; ".join(missing))
    for directory in settings.model_dirs:
        yield Check(f"models dir {directory}", directory.is_dir(), "present" if directory.is_dir() else "missing")


def _disk_checks(settings: Settings) -> Iterator[Check]:
    for name, path in (("state dir", settings.state_dir), ("gpu lock dir", settings.gpu_locks)):
        ok = path.is_dir() and os.access(path, os.W_OK | os.X_OK)
        yield Check(f"{name} {path}", ok, "writable" if ok else "missing or not writable")
    yield _ledger_check(settings)
    yield _train_root_check(settings)


def _ledger_check(settings: Settings) -> Check:
    path = settings.database_path
    if not path.exists():
        return Check("ledger", False, f"{path} missing; run `lora-worker migrate`")
    try:
        verify_integrity(path)
    except LoraWorkerError as exc:
        return Check("ledger", False, exc.message)
    current, head = current_revision(path), head_revision()
    return Check("ledger", current == head, f"{path}, schema {current}" + ("" if current == head else f" (need {head})"))


def _train_root_check(settings: Settings) -> Check:
    root = settings.train_root
    try:
        st = root.stat()
    except OSError as exc:
        return Check(f"train root {root}", False, f"unreadable: {exc.strerror}")
    mode = stat.S_IMODE(st.st_mode)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    problems = []
    if not mode & stat.S_ISGID:
        problems.append("no setgid bit (new folders would not inherit the shared group)")
    if mode & 0o070 != 0o070:
        problems.append("the group cannot read, write and enter it")
    if mode & 0o007:
        problems.append("it is open to others")
    if not os.access(root, os.W_OK | os.X_OK):
        problems.append("this user cannot write to it")
    detail = f"group {group}, mode {mode:04o}" + ("; " + "; ".join(problems) if problems else "")
    return Check(f"train root {root}", not problems, detail)

"""NVML through the worker's own binding (lora_worker/host/nvml.py, its versioned process queries included), held
against `nvidia-smi`, device by device.

The parsers and the comparison are pure (unit-tested on nvidia-smi's CSV); `live_rows` runs them on this host:
one reading through `PynvmlBackend`, each of the binding's process queries (v3, v2, v1) on its own, and
nvidia-smi's two CSV queries, while a CUDA process of the check's own holds memory on every device, so the
process lists have something to agree on.

NVML's memory info (v1, what the binding reads) counts the driver's reserved memory as used; nvidia-smi shows it
apart (NVML v2), so `used` may differ by that reserve while `total` and `free` agree: `used` is reported, the
others are compared.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bench.gpu_check.table import Row, unmeasured
from lora_worker.errors import NvmlUnavailable
from lora_worker.host import nvml
from lora_worker.host.nvml import GpuReading, PynvmlBackend

SECTION = "nvml vs nvidia-smi"
GPU_FIELDS = ("index", "pci.bus_id", "name", "uuid", "memory.total", "memory.used", "memory.free",
              "utilization.gpu", "temperature.gpu", "driver_version")
APP_FIELDS = ("gpu_bus_id", "pid", "used_memory")
FREE_TOLERANCE_MIB = 64  # two readings a moment apart, on a card nothing else uses


@dataclass(frozen=True)
class SmiGpu:
    index: int
    bus_id: str
    name: str
    uuid: str
    total_mib: int | None
    used_mib: int | None
    free_mib: int | None
    utilization_pct: int | None
    temperature_c: int | None
    driver: str | None


@dataclass(frozen=True)
class SmiApp:
    bus_id: str
    pid: int
    used_mib: int | None


def smi_gpu_command() -> list[str]:
    return ["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"]


def smi_app_command() -> list[str]:
    return ["nvidia-smi", f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,noheader,nounits"]


def parse_gpus(text: str) -> list[SmiGpu]:
    """`nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits`; ValueError on a line it cannot read."""
    gpus = []
    for line in _lines(text):
        cells = _cells(line, len(GPU_FIELDS))
        gpus.append(SmiGpu(int(cells[0]), bus_key(cells[1]), cells[2], cells[3], _int(cells[4]), _int(cells[5]),
                           _int(cells[6]), _int(cells[7]), _int(cells[8]), None if _na(cells[9]) else cells[9]))
    return gpus


def parse_apps(text: str) -> list[SmiApp]:
    """`nvidia-smi --query-compute-apps=<APP_FIELDS> …`: one line per process on a device (none: no line)."""
    return [SmiApp(bus_key(c[0]), int(c[1]), _int(c[2])) for c in (_cells(line, 3) for line in _lines(text))]


def bus_key(bus_id: str) -> str:
    """NVML's and nvidia-smi's PCI bus id in one spelling: an 8-digit domain, lower case (`00000000:01:00.0`)."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or rest.count(":") != 1:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{int(domain, 16):08x}:{rest}"


def compare(readings: list[GpuReading], gpus: list[SmiGpu], apps: list[SmiApp]) -> list[Row]:
    """Device by device (matched by PCI bus id): what the binding read against what nvidia-smi printed."""
    rows = [Row(SECTION, "devices", f"NVML {len(readings)}, nvidia-smi {len(gpus)}", ok=len(readings) == len(gpus),
                how="PynvmlBackend.read() / nvidia-smi --query-gpu")]
    smi = {g.bus_id: g for g in gpus}
    for reading in readings:
        rows += list(_device_rows(reading, smi.get(bus_key(reading.pci_bus_id)) if reading.pci_bus_id else None,
                                  [a for a in apps if reading.pci_bus_id and a.bus_id == bus_key(reading.pci_bus_id)]))
    return rows


def _device_rows(r: GpuReading, g: SmiGpu | None, apps: list[SmiApp]) -> Iterator[Row]:
    d = f"device {r.index}"
    if r.error:
        yield Row(SECTION, d, f"the binding could not read it: {r.error}", ok=False, how="PynvmlBackend")
        return
    if g is None:
        yield Row(SECTION, d, f"bus {r.pci_bus_id}: nvidia-smi lists no such device", ok=False)
        return
    yield _same(d, "index (PCI bus order)", r.index, g.index)
    yield _same(d, "name", r.name, g.name)
    yield _same(d, "uuid", r.uuid, g.uuid)
    yield _same(d, "memory total", r.memory_total_mib, g.total_mib, "MiB")
    yield _close(d, "memory free", r.memory_free_mib, g.free_mib, FREE_TOLERANCE_MIB)
    yield Row(SECTION, f"{d} memory used", f"NVML {r.memory_used_mib} MiB, nvidia-smi {g.used_mib} MiB",
              how="NVML v1 counts the driver's reserve as used; nvidia-smi shows it apart")
    yield Row(SECTION, f"{d} utilisation, temperature",
              f"NVML {r.utilization_pct} %, {r.temperature_c} °C; nvidia-smi {g.utilization_pct} %, "
              f"{g.temperature_c} °C", how="read a moment apart: reported, not compared")
    yield from _process_rows(d, r, apps)


def _process_rows(d: str, r: GpuReading, apps: list[SmiApp]) -> Iterator[Row]:
    if r.processes is None:
        yield Row(SECTION, f"{d} compute processes", f"unknown to the binding: {r.processes_error}", ok=False)
        return
    ours = {p.pid: p.used_mib for p in r.processes}
    theirs = {a.pid: a.used_mib for a in apps}
    yield Row(SECTION, f"{d} compute processes", f"NVML {sorted(ours)}, nvidia-smi {sorted(theirs)}",
              ok=set(ours) == set(theirs), how="pids")
    for pid in sorted(set(ours) & set(theirs)):
        yield _same(d, f"pid {pid} memory", ours[pid], theirs[pid], "MiB")


def _same(d: str, what: str, ours: Any, theirs: Any, unit: str = "") -> Row:
    unit = f" {unit}" if unit else ""
    value = f"both {ours}{unit}" if ours == theirs else f"NVML {ours}{unit}, nvidia-smi {theirs}{unit}"
    return Row(SECTION, f"{d} {what}", value, ok=ours == theirs and ours is not None)


def _close(d: str, what: str, ours: int | None, theirs: int | None, tolerance: int) -> Row:
    ok = ours is not None and theirs is not None and abs(ours - theirs) <= tolerance
    return Row(SECTION, f"{d} {what}", f"NVML {ours} MiB, nvidia-smi {theirs} MiB", ok=ok,
               how=f"agree within {tolerance} MiB (two readings a moment apart)")


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _cells(line: str, n: int) -> list[str]:
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != n:
        raise ValueError(f"expected {n} fields, got {len(cells)}: {line!r}")
    return cells


def _na(cell: str) -> bool:
    return cell.startswith("[") or cell in ("", "N/A")  # [N/A], [Not Supported], [Insufficient Permissions]


def _int(cell: str) -> int | None:
    return None if _na(cell) else int(float(cell))


# -- on this host --------------------------------------------------------------------------------------------

def live_rows(timeout_s: float = 5.0) -> tuple[list[Row], list[GpuReading] | None, str | None]:
    """(rows, the binding's readings or None, the driver version nvidia-smi gave or None)."""
    backend = PynvmlBackend(timeout_s)
    try:
        readings = backend.read()
    except NvmlUnavailable as exc:
        return [unmeasured(SECTION, "NVML through the worker's binding", exc.message, how="PynvmlBackend.read()")], \
            None, None
    rows = list(query_rows(backend))
    smi_gpus, smi_apps, problem = _smi()
    if problem is not None:
        return [*rows, unmeasured(SECTION, "nvidia-smi", problem)], readings, None
    rows += compare(readings, smi_gpus, smi_apps)
    return rows, readings, next((g.driver for g in smi_gpus if g.driver), None)


def query_rows(backend: PynvmlBackend) -> Iterable[Row]:
    """Each of the binding's process queries asked on its own, and the one the binding chose."""
    import pynvml

    chosen = backend._query.__name__ if backend._query is not None else None  # noqa: SLF001 - the bench reads it
    yield Row(SECTION, "process query the binding chose", str(chosen), ok=chosen is not None,
              how="PynvmlBackend: v3, else v2, else the v1 symbol")
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for query in nvml._PROCESS_QUERIES:  # noqa: SLF001 - the worker's own versioned queries, one by one
            name = f"NVML index {index}: {query.__name__}"
            try:
                procs = query(pynvml, handle)
            except pynvml.NVMLError_FunctionNotFound:
                yield Row(SECTION, name, "symbol absent in this driver", how="the binding falls back a version")
                continue
            except Exception as exc:  # noqa: BLE001 - reported as the row's finding
                yield Row(SECTION, name, f"{type(exc).__name__}: {exc}", ok=False)
                continue
            yield Row(SECTION, name, "answered: " + (", ".join(f"pid {p.pid} {p.used_mib} MiB" for p in procs)
                                                    or "no process"), ok=True)


def _smi() -> tuple[list[SmiGpu], list[SmiApp], str | None]:
    if shutil.which("nvidia-smi") is None:
        return [], [], "nvidia-smi is not on PATH"
    try:
        gpus = subprocess.run(smi_gpu_command(), capture_output=True, text=True, timeout=60, check=True).stdout
        apps = subprocess.run(smi_app_command(), capture_output=True, text=True, timeout=60, check=True).stdout
        return parse_gpus(gpus), parse_apps(apps), None
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return [], [], f"nvidia-smi failed: {exc}"


HOLDER = """
import sys, torch
held = [torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device=f"cuda:{i}")
        for i in range(torch.cuda.device_count())]
torch.cuda.synchronize()
print("ready", len(held), flush=True)
sys.stdin.read()
"""


@contextmanager
def cuda_holder(python: str, mib: int = 1024, timeout_s: float = 180.0) -> Iterator[tuple[int | None, str]]:
    """A CUDA process of the check's own (the trainer's interpreter) holding `mib` on every device while the body
    runs, so both process lists have one to show: (its pid, "") once it holds the memory, else (None, why)."""
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    proc = subprocess.Popen([python, "-c", HOLDER, str(mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,  # noqa: S603
                            stderr=subprocess.PIPE, text=True, env=env)
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(timeout_s)
    try:
        if ready and ready[0].startswith("ready"):
            yield proc.pid, ""
        elif proc.poll() is not None:
            yield None, f"it exited {proc.returncode}: {(proc.stderr.read() if proc.stderr else '')[-300:]}"
        else:
            yield None, f"it held no memory within {timeout_s:g} s"
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""The seam over NVML (nvidia-ml-py, imported as `pynvml`), and a fake with the same face for tests.

Readings come back in PCI bus order, the order the trainer sees with CUDA_DEVICE_ORDER=PCI_BUS_ID, so a
reading's `index` is the index a request names. Every call is bounded in time, and one device that fails to
answer is reported as such without hiding the others.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from lora_worker.errors import NvmlUnavailable

T = TypeVar("T")
MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: int | None  # None where the driver does not say (e.g. inside a container)


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    error: str | None = None  # set when this device could not be read


class Nvml(Protocol):
    def read(self) -> list[GpuReading]:
        """Every device, in PCI bus order; NvmlUnavailable when there is no driver at all."""
        ...


class _Timeout(Exception):
    pass


class PynvmlBackend:
    """The real NVML. Calls run on a helper thread so a wedged driver costs a bounded wait, not a request."""

    MAX_STUCK_CALLS = 4  # calls still out past their timeout, each holding a thread; past this, stop calling

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._stuck = 0
        self._stuck_lock = threading.Lock()  # not `_lock`: `_init` holds that one while it calls
        self._initialised = False
        self._lock = threading.Lock()

    def read(self) -> list[GpuReading]:
        import pynvml

        self._init(pynvml)
        try:
            count = self._call(pynvml.nvmlDeviceGetCount)
        except (_Timeout, pynvml.NVMLError) as exc:
            raise NvmlUnavailable(f"NVML did not list the devices: {exc}") from exc
        readings = [self._read_one(pynvml, i) for i in range(count)]
        if any(r.pci_bus_id is None for r in readings):
            return readings  # NVML enumerates in PCI order in practice; without every bus id, trust it
        ordered = sorted(readings, key=lambda r: r.pci_bus_id.lower())  # type: ignore[union-attr]
        return [_reindex(r, i) for i, r in enumerate(ordered)]

    def _init(self, pynvml: Any) -> None:
        with self._lock:
            if self._initialised:
                return
            try:
                self._call(pynvml.nvmlInit)
            except pynvml.NVMLError as exc:
                raise NvmlUnavailable(f"NVML is not available on this host: {exc}") from exc
            except _Timeout as exc:
                raise NvmlUnavailable("NVML did not initialise in time") from exc
            self._initialised = True

    def _read_one(self, pynvml: Any, index: int) -> GpuReading:
        bus_id = None
        try:
            handle = self._call(pynvml.nvmlDeviceGetHandleByIndex, index)
            bus_id = _text(self._call(pynvml.nvmlDeviceGetPciInfo, handle).busId)
            memory = self._call(pynvml.nvmlDeviceGetMemoryInfo, handle)
            reading: dict[str, Any] = {
                "name": _text(self._call(pynvml.nvmlDeviceGetName, handle)),
                "uuid": _text(self._call(pynvml.nvmlDeviceGetUUID, handle)),
                "pci_bus_id": bus_id,
                "memory_total_mib": memory.total // MIB,
                "memory_used_mib": memory.used // MIB,
                "memory_free_mib": memory.free // MIB,
            }
        except (_Timeout, pynvml.NVMLError) as exc:
            return GpuReading(index=index, pci_bus_id=bus_id, error=f"{type(exc).__name__}: {exc}")
        reading["utilization_pct"] = self._optional(lambda: self._call(
            pynvml.nvmlDeviceGetUtilizationRates, handle).gpu, pynvml)
        reading["temperature_c"] = self._optional(lambda: self._call(
            pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU), pynvml)
        procs = self._optional(lambda: self._call(pynvml.nvmlDeviceGetComputeRunningProcesses, handle), pynvml) or []
        reading["processes"] = tuple(
            GpuProcess(p.pid, p.usedGpuMemory // MIB if isinstance(p.usedGpuMemory, int) else None) for p in procs)
        return GpuReading(index=index, **reading)

    def _optional(self, read: Callable[[], T], pynvml: Any) -> T | None:
        try:
            return read()
        except (_Timeout, pynvml.NVMLError):
            return None

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._stuck >= self.MAX_STUCK_CALLS:
            raise _Timeout("too many NVML calls never returned")
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc
            finally:
                with self._stuck_lock:
                    box["done"] = True
                    if box.get("late"):
                        self._stuck -= 1  # a slow call came back after all: NVML is usable again

        thread = threading.Thread(target=target, daemon=True, name="nvml-call")
        thread.start()
        thread.join(self.timeout_s)
        with self._stuck_lock:
            late = box["late"] = "done" not in box
            if late:
                self._stuck += 1
        if late:
            raise _Timeout(f"{getattr(fn, '__name__', 'NVML call')} took over {self.timeout_s:g}s")
        if "error" in box:
            raise box["error"]
        return cast(T, box["value"])


@dataclass
class FakeNvml:
    """GPUs described in data. `absent` plays a host without a driver; a device dict with "error" plays
    one whose query raises. Built from a file, it re-reads the file at every read, so a test can change
    what the GPUs show while the service runs."""

    devices: list[dict[str, Any]] = field(default_factory=list)
    absent: bool = False
    path: Path | None = None

    @classmethod
    def from_file(cls, path: Path) -> FakeNvml:
        return cls(path=path)

    def read(self) -> list[GpuReading]:
        if self.path is not None:
            doc = json.loads(self.path.read_text())
            self.devices, self.absent = doc.get("devices", []), bool(doc.get("absent", False))
        if self.absent:
            raise NvmlUnavailable("NVML is not available on this host: NVML Shared Library Not Found")
        readings = []
        for i, dev in enumerate(sorted(self.devices, key=lambda d: d.get("pci_bus_id", ""))):
            if dev.get("error"):
                readings.append(GpuReading(index=i, error=str(dev["error"])))
                continue
            total, used = int(dev["memory_total_mib"]), int(dev.get("memory_used_mib", 0))
            procs = tuple(GpuProcess(int(p["pid"]), p.get("used_mib")) for p in dev.get("processes", []))
            readings.append(GpuReading(
                index=i, name=dev.get("name"), uuid=dev.get("uuid"), pci_bus_id=dev.get("pci_bus_id"),
                memory_total_mib=total, memory_used_mib=used, memory_free_mib=total - used,
                utilization_pct=dev.get("utilization_pct"), temperature_c=dev.get("temperature_c"),
                processes=procs))
        return readings


def make_nvml(timeout_s: float, fake_file: Path | None) -> Nvml:
    return FakeNvml.from_file(fake_file) if fake_file else PynvmlBackend(timeout_s)


def _reindex(reading: GpuReading, index: int) -> GpuReading:
    return reading if reading.index == index else GpuReading(**{**reading.__dict__, "index": index})


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

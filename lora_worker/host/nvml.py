"""The seam over NVML (nvidia-ml-py, imported as `pynvml`), and a fake with the same face for tests.

Readings come back in PCI bus order, the order the trainer sees with CUDA_DEVICE_ORDER=PCI_BUS_ID, so a
reading's `index` is the index a request names. Every call is bounded in time, and one device that fails to
answer is reported as such without hiding the others.

It fails closed: a process query that fails (NotSupported, NoPermission, GpuIsLost, …) leaves the device's
processes unknown (`processes` None, `processes_error` why), never "none". The query is resolved version by
version (`nvmlDeviceGetComputeRunningProcesses_v3`, `_v2`, then the v1 symbol), each with its own structure:
pynvml's unversioned name is the `_v3` symbol and raises NVMLLibraryMismatchError (not an NVMLError) on a
driver without it. Any exception at this seam is NvmlUnavailable or a device's `error`, never an escape.
"""
from __future__ import annotations

import ctypes
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
    processes: tuple[GpuProcess, ...] | None = ()  # None: unknown (the query failed; see processes_error)
    error: str | None = None  # set when this device could not be read
    processes_error: str | None = None  # why the processes are unknown


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
        self._query: Callable[[Any, Any], tuple[GpuProcess, ...]] | None = None  # the process query that answered

    def read(self) -> list[GpuReading]:
        try:
            import pynvml
        except Exception as exc:  # noqa: BLE001 - no binding is no NVML, whatever the import raised
            raise NvmlUnavailable(f"NVML is not available on this host: {exc}") from exc
        self._init(pynvml)
        try:
            count = self._call(pynvml.nvmlDeviceGetCount)
        except Exception as exc:  # noqa: BLE001 - NVMLError, NVMLLibraryMismatchError, a timeout, a broken binding
            raise NvmlUnavailable(f"NVML did not list the devices: {_cause(exc)}") from exc
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
            except _Timeout as exc:
                raise NvmlUnavailable("NVML did not initialise in time") from exc
            except Exception as exc:  # noqa: BLE001 - see read()
                raise NvmlUnavailable(f"NVML is not available on this host: {_cause(exc)}") from exc
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
        except Exception as exc:  # noqa: BLE001 - this device is unreadable; the others still answer
            return GpuReading(index=index, pci_bus_id=bus_id, error=_cause(exc))
        reading["utilization_pct"] = self._optional(lambda: self._call(
            pynvml.nvmlDeviceGetUtilizationRates, handle).gpu, pynvml)
        reading["temperature_c"] = self._optional(lambda: self._call(
            pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU), pynvml)
        try:
            reading["processes"] = self._processes(pynvml, handle)
        except Exception as exc:  # noqa: BLE001 - unknown, not "none": admission refuses the device
            reading["processes"], reading["processes_error"] = None, _cause(exc)
        return GpuReading(index=index, **reading)

    def _processes(self, pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
        """The device's compute processes through the newest query symbol this driver has."""
        if self._query is None:
            for query in _PROCESS_QUERIES:
                try:
                    procs = self._call(query, pynvml, handle)
                except pynvml.NVMLError_FunctionNotFound:
                    continue  # an older driver: try the next version down
                self._query = query
                return procs
            raise NvmlUnavailable("the driver has no nvmlDeviceGetComputeRunningProcesses symbol (v3, v2 or v1)")
        return self._call(self._query, pynvml, handle)

    def _optional(self, read: Callable[[], T], pynvml: Any) -> T | None:
        try:
            return read()
        except Exception:  # noqa: BLE001 - utilisation and temperature are informative only
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
    one whose query raises, one with "processes_error" one whose process query fails (processes unknown).
    Built from a file, it re-reads the file at every read, so a test can change what the GPUs show while the
    service runs."""

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
            procs: tuple[GpuProcess, ...] | None = tuple(
                GpuProcess(int(p["pid"]), p.get("used_mib")) for p in dev.get("processes", []))
            if dev.get("processes_error"):
                procs = None
            readings.append(GpuReading(
                index=i, name=dev.get("name"), uuid=dev.get("uuid"), pci_bus_id=dev.get("pci_bus_id"),
                memory_total_mib=total, memory_used_mib=used, memory_free_mib=total - used,
                utilization_pct=dev.get("utilization_pct"), temperature_c=dev.get("temperature_c"),
                processes=procs, processes_error=dev.get("processes_error")))
        return readings


class _ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t, what the unversioned (v1) symbol fills: the v2/v3 structure without the MIG ids."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _processes_v3(pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    return _as_processes(pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle))


def _processes_v2(pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    return _as_processes(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(handle))


def _processes_v1(pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    """The v1 symbol with its own two-field structure (pynvml has no wrapper for it): ask for the count,
    then for that many and some spare, as pynvml's versioned wrappers do."""
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == pynvml.NVML_SUCCESS:
        return ()
    if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(ret)
    count.value = count.value * 2 + 5
    infos = (_ProcessInfoV1 * count.value)()
    ret = fn(handle, ctypes.byref(count), infos)
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)
    not_available = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    return tuple(GpuProcess(int(p.pid), None if p.usedGpuMemory == not_available else p.usedGpuMemory // MIB)
                 for p in infos[:count.value])


_PROCESS_QUERIES = (_processes_v3, _processes_v2, _processes_v1)


def _as_processes(procs: Any) -> tuple[GpuProcess, ...]:
    return tuple(GpuProcess(int(p.pid), p.usedGpuMemory // MIB if isinstance(p.usedGpuMemory, int) else None)
                 for p in procs)


def _cause(exc: BaseException) -> str:
    """An exception as a sentence naming its class: `NVMLError_NotSupported: Not Supported`."""
    return f"{type(exc).__name__}: {exc}"


def make_nvml(timeout_s: float, fake_file: Path | None) -> Nvml:
    return FakeNvml.from_file(fake_file) if fake_file else PynvmlBackend(timeout_s)


def _reindex(reading: GpuReading, index: int) -> GpuReading:
    return reading if reading.index == index else GpuReading(**{**reading.__dict__, "index": index})


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

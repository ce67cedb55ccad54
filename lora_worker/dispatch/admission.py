"""May a job of this tier start on this device now? Asked before any row turns active or any process starts."""
from __future__ import annotations

from lora_worker.config import Settings
from lora_worker.errors import GpuBusy, GpuLocked, InsufficientVram, InvalidRequest, NvmlUnavailable
from lora_worker.host.nvml import GpuReading, Nvml
from lora_worker.host.processes import describe_process
from lora_worker.host.locks import gpu_lock_path, is_locked


def admit(tier: str, device_index: int, settings: Settings, nvml: Nvml) -> GpuReading:
    """The device's reading if the job may start there; otherwise the refusal, as a domain error.

    No job of ours is active when this runs (the one-active-job check comes first), so every compute
    process on the device is foreign, and a held device lock belongs to another trainer.
    """
    readings = nvml.read()
    reading = next((r for r in readings if r.index == device_index), None)
    if reading is None:
        raise InvalidRequest({"device_index": [
            f"Device {device_index} is configured but not present on this host ({len(readings)} GPU(s) seen)."]})
    if reading.error:
        raise NvmlUnavailable(f"Device {device_index} could not be read: {reading.error}",
                              device_index=device_index)
    if is_locked(gpu_lock_path(settings, device_index)):
        raise GpuLocked(f"Another trainer holds the lock of GPU {device_index} "
                        f"({gpu_lock_path(settings, device_index)}).", device_index=device_index)
    if not settings.allow_cotenancy:
        require_no_foreign_process(reading, device_index)
    need = settings.devices[device_index].vram_mib[tier]
    free = reading.memory_free_mib or 0
    if free < need:
        raise InsufficientVram(f"GPU {device_index} has {free} MiB free; tier {tier!r} needs {need} MiB.",
                               device_index=device_index, free_mib=free, need_mib=need)
    return reading


def require_no_foreign_process(reading: GpuReading, device_index: int) -> None:
    """GpuBusy if a compute process is on the device; NvmlUnavailable if NVML could not say."""
    if reading.processes is None:
        # Unknown is not free: a TTS server or a foreign job may be there (fail closed, never guess).
        raise NvmlUnavailable(f"GPU {device_index}'s compute processes cannot be read ({reading.processes_error}); "
                              "the device is refused until they can.", device_index=device_index,
                              cause=reading.processes_error)
    if reading.processes:
        procs = [{"pid": p.pid, "name": describe_process(p.pid)[0], "used_mib": p.used_mib}
                 for p in reading.processes]
        names = ", ".join(f"{p['name'] or '?'} (pid {p['pid']})" for p in procs)
        raise GpuBusy(f"GPU {device_index} is in use by {names}.", device_index=device_index, processes=procs)

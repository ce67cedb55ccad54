"""`GET /gpu-status`: each device's memory and compute processes, whose they are, whether TTS is live, and
whether another trainer holds the device's interlock (so a client learns it before a POST is refused)."""
from __future__ import annotations

import os
import re
from typing import Any

import psutil

from lora_worker.config import Settings
from lora_worker.host.locks import gpu_lock_path, lock_state
from lora_worker.host.nvml import GpuProcess, GpuReading
from lora_worker.host.processes import describe_process
from lora_worker.ledger.models import Job


def is_ours(pid: int, job: Job | None) -> bool:
    """Whether a GPU process belongs to the active job: in its trainer's process group, or under its
    supervisor (a grandchild that left the group)."""
    if job is None or not job.trainer_pid:
        return False
    try:
        if os.getpgid(pid) == job.trainer_pid:
            return True
        return any(parent.pid == job.supervisor_pid for parent in psutil.Process(pid).parents())
    except (ProcessLookupError, PermissionError, psutil.Error):
        return False


def tts_processes(reading: GpuReading, settings: Settings, job: Job | None) -> list[GpuProcess] | None:
    """The TTS processes on the device; None when its processes are unknown (the query failed)."""
    if reading.processes is None:
        return None
    pattern = re.compile(settings.tts_process_pattern)
    matched = []
    for proc in reading.processes:
        name, cmdline = describe_process(proc.pid)
        if not is_ours(proc.pid, job) and pattern.search(f"{name or ''} {cmdline}"):
            matched.append(proc)
    return matched


def gpu_status(readings: list[GpuReading], settings: Settings, job: Job | None) -> dict[str, Any]:
    devices = []
    tts_live: bool | None = False  # None: the TTS device's processes are unknown, and so is TTS
    for reading in readings:
        tts: list[GpuProcess] | None = []
        if reading.index == settings.tts_device_index:
            tts = None if reading.error else tts_processes(reading, settings, job)
            tts_live = None if tts is None else bool(tts)
        devices.append(_device(reading, settings, job, tts or []))
    return {"devices": devices, "tts_on_3090": tts_live, "active_job_id": job.id if job else None}


def _device(reading: GpuReading, settings: Settings, job: Job | None, tts: list[GpuProcess]) -> dict[str, Any]:
    profile = settings.device(reading.index)
    return {
        "index": reading.index,
        "label": profile.label if profile else None,
        "allowed_tiers": sorted(profile.tiers) if profile else [],
        "name": reading.name,
        "uuid": reading.uuid,
        "pci_bus_id": reading.pci_bus_id,
        "memory_total_mib": reading.memory_total_mib,
        "memory_used_mib": reading.memory_used_mib,
        "memory_free_mib": reading.memory_free_mib,
        "utilization_pct": reading.utilization_pct,
        "temperature_c": reading.temperature_c,
        "processes": None if reading.processes is None else [_process(p, job, tts) for p in reading.processes],
        "processes_error": reading.processes_error,
        "lock": _lock(settings, reading.index, job),
        "error": reading.error,
    }


def _process(proc: GpuProcess, job: Job | None, tts: list[GpuProcess]) -> dict[str, Any]:
    name, _ = describe_process(proc.pid)
    return {"pid": proc.pid, "name": name, "used_mib": proc.used_mib, "ours": is_ours(proc.pid, job),
            "tts": proc in tts}


def _lock(settings: Settings, index: int, job: Job | None) -> dict[str, Any]:
    """The device's interlock: held or not, by which pid, and whether that is our own job's supervisor."""
    state = lock_state(gpu_lock_path(settings, index))
    name = describe_process(state.holder_pid)[0] if state.holder_pid else None
    ours = bool(job is not None and state.holder_pid and state.holder_pid == job.supervisor_pid)
    return {"held": state.held, "holder_pid": state.holder_pid, "holder_name": name, "ours": ours}

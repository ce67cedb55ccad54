"""NVML fails closed: the real nvidia-ml-py (its exception classes, its versioned process wrappers, its
unversioned-name check) over a driver played by replacing only the device calls: the `nvmlDevice*` Python
calls that read memory and names, and the ctypes symbol lookup (`_nvmlGetFunctionPointer`) behind the
process query, so pynvml's own wrappers fill the structures a driver of each version would."""
from __future__ import annotations

import ctypes
import types

import pynvml
import pytest

from lora_worker import create_app
from lora_worker.errors import NvmlUnavailable
from lora_worker.host.nvml import PynvmlBackend

V1_STRUCT_BYTES = 16  # nvmlProcessInfo_v1_t: pid, usedGpuMemory
V2_STRUCT_BYTES = 24  # nvmlProcessInfo_v2_t (and _v3): pid, usedGpuMemory, gpuInstanceId, computeInstanceId


def process_symbol(procs: list[tuple[int, int]], struct_bytes: int, *, error: int | None = None):
    """A driver's C function for the process query: the two-call protocol, checked against its structure."""
    def fn(handle, count_ref, infos):  # type: ignore[no-untyped-def]
        count = count_ref._obj
        if error is not None:
            return error
        if infos is None:
            if not procs:
                return pynvml.NVML_SUCCESS
            count.value = len(procs)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert ctypes.sizeof(infos._type_) == struct_bytes, "the wrong structure for this symbol's version"
        assert len(infos) >= len(procs)
        for i, (pid, used) in enumerate(procs):
            infos[i].pid, infos[i].usedGpuMemory = pid, used
        count.value = len(procs)
        return pynvml.NVML_SUCCESS
    return fn


@pytest.fixture
def driver(monkeypatch):
    """A host with two GPUs (bus 01: the 3090, bus 02: the A6000); `symbols` is what its library exports."""
    symbols: dict[str, object] = {}
    ns = types.SimpleNamespace
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPciInfo", lambda h: ns(busId=f"00000000:0{h + 1}:00.0".encode()))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: ns(total=24_576 << 20, used=0, free=24_576 << 20))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: ["NVIDIA GeForce RTX 3090", "NVIDIA RTX A6000"][h])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-{h}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", lambda h: ns(gpu=0))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", lambda h, sensor: 40)

    def lookup(name: str):  # type: ignore[no-untyped-def]
        if name not in symbols:  # what pynvml's lookup raises for a symbol the library lacks
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return symbols[name]

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lookup)
    return symbols


V3, V2, V1 = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
              "nvmlDeviceGetComputeRunningProcesses")


@pytest.mark.parametrize("present, struct_bytes", [((V3, V2, V1), V2_STRUCT_BYTES), ((V2, V1), V2_STRUCT_BYTES),
                                                    ((V1,), V1_STRUCT_BYTES)])
def test_the_process_query_uses_the_newest_symbol_the_driver_has_with_its_structure(driver, present, struct_bytes):
    newest = present[0]
    for name in present:  # an older symbol would answer nothing: only the newest one may be asked
        driver[name] = process_symbol([(4242, 3 << 30)] if name == newest else [], struct_bytes
                                      if name == newest else 0)
    first, _ = PynvmlBackend(timeout_s=2).read()
    assert first.processes is not None and [(p.pid, p.used_mib) for p in first.processes] == [(4242, 3072)]
    assert first.processes_error is None


def test_the_unversioned_name_is_not_called_on_a_driver_without_v3(driver):
    """pynvml's `nvmlDeviceGetComputeRunningProcesses` is the _v3 symbol: on such a driver it raises
    NVMLLibraryMismatchError, which is no NVMLError."""
    driver[V2] = process_symbol([], V2_STRUCT_BYTES)
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        pynvml.nvmlDeviceGetComputeRunningProcesses(0)
    readings = PynvmlBackend(timeout_s=2).read()
    assert [r.processes for r in readings] == [(), ()]


@pytest.mark.parametrize("error, cls", [(pynvml.NVML_ERROR_NOT_SUPPORTED, "NVMLError_NotSupported"),
                                        (pynvml.NVML_ERROR_NO_PERMISSION, "NVMLError_NoPermission"),
                                        (pynvml.NVML_ERROR_GPU_IS_LOST, "NVMLError_GpuIsLost")])
def test_a_failed_process_query_is_unknown_not_none(driver, error, cls):
    driver[V3] = process_symbol([], V2_STRUCT_BYTES, error=error)
    driver[V2] = process_symbol([], V2_STRUCT_BYTES)  # an older symbol that answers "none" is not asked instead
    first, _ = PynvmlBackend(timeout_s=2).read()
    assert first.processes is None and first.error is None
    assert first.processes_error and first.processes_error.startswith(cls)


def test_a_driver_without_any_process_symbol_is_unknown(driver):
    first, _ = PynvmlBackend(timeout_s=2).read()
    assert first.processes is None and "no nvmlDeviceGetComputeRunningProcesses" in (first.processes_error or "")


@pytest.mark.parametrize("exc", [pynvml.NVMLLibraryMismatchError("mismatch"), AttributeError("no such function"),
                                 pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND), RuntimeError("odd")])
def test_any_exception_listing_the_devices_is_nvml_unavailable(driver, monkeypatch, exc):
    def count() -> int:
        raise exc

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", count)
    with pytest.raises(NvmlUnavailable, match=type(exc).__name__):
        PynvmlBackend(timeout_s=2).read()


@pytest.mark.parametrize("exc", [pynvml.NVMLLibraryMismatchError("mismatch"), AttributeError("gone")])
def test_any_exception_reading_a_device_is_that_devices_error(driver, monkeypatch, exc):
    def memory(handle):  # type: ignore[no-untyped-def]
        raise exc

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", memory)
    first, second = PynvmlBackend(timeout_s=2).read()
    assert first.error and type(exc).__name__ in first.error and second.error


# -- what the API answers -----------------------------------------------------------------------------------------

def api_with_driver(settings, launches):
    return create_app(settings, nvml=PynvmlBackend(timeout_s=2), launch=launches).test_client()


def test_unknown_processes_refuse_the_device_with_a_503_naming_the_cause(driver, migrated, host, launches):
    driver[V3] = process_symbol([], V2_STRUCT_BYTES, error=pynvml.NVML_ERROR_NO_PERMISSION)
    client = api_with_driver(migrated, launches)
    response = client.post("/train", json=host.payload())
    body = response.get_json()
    assert response.status_code == 503 and body["error"] == "nvml_unavailable", body
    assert "NVMLError_NoPermission" in body["message"] and body["retryable"] is False
    assert launches == []
    status = client.get("/gpu-status").get_json()
    assert status["tts_on_3090"] is None  # unknown, never false
    assert status["devices"][0]["processes"] is None and "NoPermission" in status["devices"][0]["processes_error"]


def test_known_processes_still_admit(driver, migrated, host, launches):
    driver[V2] = process_symbol([], V2_STRUCT_BYTES)  # a driver without _v3
    response = api_with_driver(migrated, launches).post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()
    assert len(launches) == 1


@pytest.mark.parametrize("where", ["count", "process_query"])
def test_no_route_answers_500_for_an_nvml_seam_error(driver, monkeypatch, migrated, host, launches, where):
    def broken(*args):  # type: ignore[no-untyped-def]
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called")

    if where == "count":
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", broken)
    else:
        driver[V3] = broken
    client = api_with_driver(migrated, launches)
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 200
    gpu = client.get("/gpu-status")
    assert gpu.status_code in (200, 503) and (gpu.status_code == 200 or gpu.get_json()["error"] == "nvml_unavailable")
    train = client.post("/train", json=host.payload())
    assert train.status_code == 503 and train.get_json()["error"] == "nvml_unavailable", train.get_json()
    assert launches == []

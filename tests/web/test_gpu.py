"""GPU status and admission with a fake NVML; the pynvml backend against a stub of the library."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import types
from dataclasses import replace

import pynvml
import pytest

from lora_worker import create_app
from lora_worker.dispatch.disk import checkpoint_mib
from lora_worker.errors import NvmlUnavailable
from lora_worker.host.nvml import PynvmlBackend
from lora_worker.host.locks import gpu_lock_path
from tests.helpers import fake_gpus, set_modes, wait_for
from tests.helpers.api import assert_refused


@pytest.fixture
def process_named():
    """Start a sleeping process whose command line carries the given words (a TTS server, a foreign job)."""
    procs = []

    def start(*words: str) -> int:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *words])
        procs.append(proc)
        return proc.pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def make_client(settings, launches=None):
    app = create_app(settings, launch=launches)
    return app.test_client()


@pytest.mark.slow
def test_gpu_status_reports_every_field_in_pci_order(migrated, host, process_named):
    foreign = process_named("some_other_job.py")
    fake_gpus(host.gpus, free0=20_000, free1=40_000, processes1=[{"pid": foreign, "used_mib": 2048}])
    doc = json.loads(host.gpus.read_text())
    doc["devices"].reverse()  # NVML may list them in another order; PCI bus order wins
    host.gpus.write_text(json.dumps(doc))
    body = make_client(migrated).get("/gpu-status").get_json()
    first, second = body["devices"]
    assert (first["index"], first["pci_bus_id"], first["name"]) == (0, "00000000:01:00.0", "NVIDIA GeForce RTX 3090")
    assert (second["index"], second["label"], second["allowed_tiers"]) == (1, "48g", ["balanced", "fast", "quality"])
    assert (first["memory_total_mib"], first["memory_used_mib"], first["memory_free_mib"]) == (24_576, 4_576, 20_000)
    assert (first["utilization_pct"], first["temperature_c"], first["uuid"], first["error"]) == (3, 41, "GPU-3090",
                                                                                                 None)
    (proc,) = second["processes"]
    assert (proc["pid"], proc["used_mib"], proc["ours"], proc["tts"]) == (foreign, 2048, False, False)
    assert proc["name"].startswith("python")
    assert body["tts_on_3090"] is False and body["active_job_id"] is None


@pytest.mark.slow
def test_tts_on_3090_is_true_only_when_a_tts_process_runs_on_device_0(migrated, host, process_named):
    tts = process_named("tts_server.py", "--port", "5002")
    fake_gpus(host.gpus, processes0=[{"pid": tts, "used_mib": 3000}])
    client = make_client(migrated)
    body = client.get("/gpu-status").get_json()
    assert body["tts_on_3090"] is True and body["devices"][0]["processes"][0]["tts"] is True
    fake_gpus(host.gpus, processes1=[{"pid": tts, "used_mib": 3000}])  # the same server on the other card
    assert client.get("/gpu-status").get_json()["tts_on_3090"] is False
    other = process_named("comfyui", "main.py")
    fake_gpus(host.gpus, processes0=[{"pid": other, "used_mib": 3000}])
    assert client.get("/gpu-status").get_json()["tts_on_3090"] is False


@pytest.mark.slow
def test_the_tts_matcher_is_configurable(migrated, host, process_named):
    voice = process_named("voicebox-daemon")
    fake_gpus(host.gpus, processes0=[{"pid": voice, "used_mib": 1}])
    assert make_client(migrated).get("/gpu-status").get_json()["tts_on_3090"] is False
    custom = replace(migrated, tts_process_pattern=r"voicebox")
    assert make_client(custom).get("/gpu-status").get_json()["tts_on_3090"] is True


def test_without_nvml_gpu_status_is_a_503_and_health_stays_ok(migrated, host):
    fake_gpus(host.gpus, absent=True)
    client = make_client(migrated)
    response = client.get("/gpu-status")
    assert response.status_code == 503 and response.get_json()["error"] == "nvml_unavailable"
    health = client.get("/healthz")
    assert health.status_code == 200 and health.get_json()["nvml"].startswith("unavailable")
    assert health.get_json()["status"] == "ok"


def test_a_device_whose_query_raises_does_not_hide_the_other(migrated, host, launches):
    doc = json.loads(fake_gpus(host.gpus).read_text())
    doc["devices"][1] = {"pci_bus_id": "00000000:02:00.0", "error": "NVMLError_GpuIsLost: GPU is lost"}
    host.gpus.write_text(json.dumps(doc))
    client = make_client(migrated, launches)
    devices = client.get("/gpu-status").get_json()["devices"]
    assert devices[0]["memory_free_mib"] == 20_000 and devices[0]["error"] is None
    assert "GPU is lost" in devices[1]["error"]
    assert_refused(client.post("/train", json=host.payload(device_index=1)), 503, "nvml_unavailable", migrated,
                   launches)
    assert client.post("/train", json=host.payload(device_index=0)).status_code == 202


# -- admission -------------------------------------------------------------------------------------------------

def test_too_little_free_vram_is_a_409(migrated, host, launches):
    fake_gpus(host.gpus, free1=10_000)
    body = assert_refused(make_client(migrated, launches).post("/train", json=host.payload()), 409,
                          "insufficient_vram", migrated, launches)
    assert (body["details"]["free_mib"], body["details"]["need_mib"]) == (10_000, 16_000)


def test_the_vram_a_tier_needs_comes_from_the_device_profile(migrated, host, launches):
    fake_gpus(host.gpus, free1=20_000)  # enough for fast (16 000), not for quality (24 000)
    client = make_client(migrated, launches)
    assert_refused(client.post("/train", json=host.payload(tier="quality")), 409, "insufficient_vram", migrated,
                   launches)
    assert client.post("/train", json=host.payload(tier="fast")).status_code == 202


@pytest.mark.slow
def test_a_foreign_compute_process_is_a_409_naming_it(migrated, host, launches, process_named):
    stranger = process_named("stranger_training.py")
    fake_gpus(host.gpus, processes1=[{"pid": stranger, "used_mib": 9000}])
    body = assert_refused(make_client(migrated, launches).post("/train", json=host.payload()), 409, "gpu_busy",
                          migrated, launches)
    assert body["details"]["processes"][0]["pid"] == stranger and str(stranger) in body["message"]


@pytest.mark.slow
def test_co_tenancy_can_be_allowed_by_configuration(migrated, host, launches, process_named):
    fake_gpus(host.gpus, processes1=[{"pid": process_named("tts_server"), "used_mib": 3000}])
    client = make_client(replace(migrated, allow_cotenancy=True), launches)
    assert client.post("/train", json=host.payload()).status_code == 202


@pytest.mark.slow
def test_another_trainer_holding_the_device_lock_is_a_409(migrated, host, launches):
    client = make_client(migrated, launches)  # creates the lock directory
    lock = gpu_lock_path(migrated, 1)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)")],
        stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        body = assert_refused(client.post("/train", json=host.payload()), 409, "gpu_locked", migrated, launches)
        assert str(lock) in body["message"]
        assert client.post("/train", json=host.payload(device_index=0)).status_code == 202
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()  # type: ignore[union-attr]


def test_too_little_disk_is_a_507_not_to_be_retried(migrated, host, launches):
    greedy = replace(migrated, disk_mib={"fast": 10**12, "balanced": 1, "quality": 1})
    body = assert_refused(make_client(greedy, launches).post("/train", json=host.payload()), 507,
                          "insufficient_disk", migrated, launches)
    # the tier's disk_mib and what its step checkpoints take (fast: dim 16, a state, its 4 sampled step LoRAs, the
    # 5 images of its default prompt)
    assert body["details"]["need_mib"] == 10**12 + checkpoint_mib(16, 4, 5) and body["retryable"] is False


def test_the_disk_preflight_counts_the_checkpoints(migrated, host, launches):
    """Room for the LoRA alone is not enough: the states and step LoRAs the run writes need theirs."""
    free = shutil.disk_usage(host.root).free // (1024 * 1024)
    alone = free - checkpoint_mib(16) // 2  # fits with room to spare, but not with the checkpoints
    tight = replace(migrated, disk_mib={"fast": alone, "balanced": 1, "quality": 1})
    body = assert_refused(make_client(tight, launches).post("/train", json=host.payload(samples=[])), 507,
                          "insufficient_disk", migrated, launches)
    assert body["details"]["need_mib"] == alone + checkpoint_mib(16)


def test_the_disk_preflight_counts_every_sampled_step_lora_and_the_images(migrated, host, launches):
    """With samples the run keeps each sampled step LoRA (85 MiB at dim 16) and writes its images: a request with
    two prompts needs room for 4 step LoRAs and 2 x 5 images beyond what one without samples needs."""
    free = shutil.disk_usage(host.root).free // (1024 * 1024)
    alone = free - checkpoint_mib(16) // 2
    tight = replace(migrated, disk_mib={"fast": alone, "balanced": 1, "quality": 1})
    two = [{"prompt": "photo of ohwx woman"}, {"prompt": "ohwx woman in a red coat"}]
    body = assert_refused(make_client(tight, launches).post("/train", json=host.payload(samples=two)), 507,
                          "insufficient_disk", migrated, launches)
    assert body["details"]["need_mib"] == alone + checkpoint_mib(16, 4, 10) == alone + checkpoint_mib(16) + 3 * 85 + 20


def test_a_configured_device_missing_from_the_host_is_a_422(migrated, host, launches):
    doc = json.loads(fake_gpus(host.gpus).read_text())
    del doc["devices"][1]
    host.gpus.write_text(json.dumps(doc))
    assert_refused(make_client(migrated, launches).post("/train", json=host.payload()), 422, "validation_failed",
                   migrated, launches, "device_index")


def test_without_nvml_nothing_is_admitted(migrated, host, launches):
    fake_gpus(host.gpus, absent=True)
    assert_refused(make_client(migrated, launches).post("/train", json=host.payload()), 503, "nvml_unavailable",
                   migrated, launches)


@pytest.mark.slow
def test_our_own_running_job_holding_the_lock_never_blocks_status_or_cancel(client, host):
    set_modes(host.sd_scripts, hang_in="training")
    job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
    wait_for(lambda: client.get(f"/train/{job_id}").get_json()["phase"] == "training", what="training")
    fd = os.open(gpu_lock_path(host.settings, 1), os.O_RDONLY)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the supervisor holds the device lock
    os.close(fd)
    assert client.get("/gpu-status").status_code == 200
    assert client.post(f"/train/{job_id}/cancel").status_code == 202
    wait_for(lambda: client.get(f"/train/{job_id}").get_json()["status"] == "cancelled", what="cancelled")


# -- the pynvml backend -------------------------------------------------------------------------------------------

class StubNvml(types.SimpleNamespace):
    """The slice of nvidia-ml-py the backend calls, answering from data."""


def stub_pynvml(devices: list[dict], *, init_error: bool = False, slow: dict[str, float] | None = None) -> StubNvml:
    class NVMLError(Exception):
        pass

    class NVMLError_FunctionNotFound(NVMLError):  # noqa: N801 - pynvml's name
        pass

    def maybe_slow(name: str, index: int) -> None:
        if slow and f"{name}:{index}" in slow:
            time.sleep(slow[f"{name}:{index}"])

    def init() -> None:
        if init_error:
            raise NVMLError("Driver Not Loaded")

    def call(name: str, getter):  # type: ignore[no-untyped-def]
        def fn(handle, *args):  # type: ignore[no-untyped-def]
            maybe_slow(name, handle)
            value = devices[handle].get(name)
            if isinstance(value, Exception):
                raise value
            return getter(value)
        return fn

    ns = types.SimpleNamespace
    return StubNvml(
        NVMLError=NVMLError, NVMLError_FunctionNotFound=NVMLError_FunctionNotFound, NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=call("bus", lambda v: ns(busId=v)),
        nvmlDeviceGetMemoryInfo=call("mem", lambda v: ns(total=v[0] << 20, used=v[1] << 20, free=(v[0] - v[1]) << 20)),
        nvmlDeviceGetName=call("name", lambda v: v),
        nvmlDeviceGetUUID=call("uuid", lambda v: v),
        nvmlDeviceGetUtilizationRates=call("util", lambda v: ns(gpu=v)),
        nvmlDeviceGetTemperature=call("temp", lambda v: v),
        nvmlDeviceGetComputeRunningProcesses_v3=call("procs", lambda v: [ns(pid=p, usedGpuMemory=m) for p, m in v]),
    )


def dev(bus: str, name: str, **extra: object) -> dict:
    return {"bus": bus, "name": name, "uuid": f"GPU-{name}", "mem": (24_576, 1_000), "util": 5, "temp": 40,
            "procs": [(123, 512 << 20)], **extra}


def test_the_backend_calls_only_functions_nvidia_ml_py_has():
    stub = stub_pynvml([])
    assert all(hasattr(pynvml, name) for name in vars(stub))


def test_the_backend_orders_devices_by_pci_bus(monkeypatch):
    stub = stub_pynvml([dev("00000000:02:00.0", "A6000", mem=(49_140, 0)), dev("00000000:01:00.0", "3090")])
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    readings = PynvmlBackend(timeout_s=1).read()
    assert [(r.index, r.name, r.memory_total_mib) for r in readings] == [(0, "3090", 24_576), (1, "A6000", 49_140)]
    assert readings[0].processes[0].pid == 123 and readings[0].processes[0].used_mib == 512


def test_the_backend_bounds_each_call_and_keeps_the_other_device(monkeypatch):
    stub = stub_pynvml([dev("00000000:01:00.0", "3090"), dev("00000000:02:00.0", "A6000")],
                       slow={"mem:1": 3.0})
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    started = time.monotonic()
    readings = PynvmlBackend(timeout_s=0.2).read()
    assert time.monotonic() - started < 2.0
    assert readings[0].error is None and readings[0].memory_free_mib == 23_576
    assert readings[1].error and "took over" in readings[1].error


def test_calls_that_time_out_stop_nvml_only_until_they_come_back(monkeypatch):
    slow = {"mem:0": 0.6}
    stub = stub_pynvml([dev("00000000:01:00.0", "3090")], slow=slow)
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    backend = PynvmlBackend(timeout_s=0.05)
    for _ in range(PynvmlBackend.MAX_STUCK_CALLS):
        assert "took over" in backend.read()[0].error
    with pytest.raises(NvmlUnavailable, match="never returned"):  # four calls still out: stop calling
        backend.read()
    slow.clear()
    time.sleep(0.8)  # the slow calls return, late
    assert backend.read()[0].error is None  # and NVML is read again, without a restart


def test_a_device_error_is_reported_for_that_device_only(monkeypatch):
    stub = stub_pynvml([dev("00000000:01:00.0", "3090"), dev("00000000:02:00.0", "A6000")])
    stub.nvmlDeviceGetMemoryInfo = lambda h: (_ for _ in ()).throw(stub.NVMLError("GPU is lost")) if h == 1 else \
        types.SimpleNamespace(total=1 << 30, used=0, free=1 << 30)
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    readings = PynvmlBackend(timeout_s=1).read()
    assert readings[0].error is None and "GPU is lost" in (readings[1].error or "")
    assert readings[1].pci_bus_id == "00000000:02:00.0"


def test_no_driver_is_nvml_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", stub_pynvml([], init_error=True))
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        PynvmlBackend(timeout_s=1).read()


def test_doctor_reports_each_check_and_fails_on_what_is_missing(migrated, host, capsys, monkeypatch):
    from lora_worker.ops import cli
    from lora_worker.dispatch import readiness
    migrated = replace(migrated, arbo_user="root", gpu_lock_group="root")  # this host's names: root's group
    monkeypatch.setattr(cli, "load_settings", lambda: migrated)
    monkeypatch.setattr(readiness, "HIDDEN_BY_UNIT", ())  # the test host lives in /tmp, which the unit hides
    os.chmod(migrated.train_root, 0o2770)
    assert cli.main(["migrate"]) == 0  # creates the state dir's lock folders
    os.chmod(migrated.gpu_locks, 0o3770)  # as the tmpfiles entry makes it
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "[  ok] nvml: 2 device(s)" in out and "[  ok] device 1 (48g): NVIDIA RTX A6000" in out
    assert "mode 2770" in out and "checks passed" in out
    os.chmod(migrated.train_root, 0o755)
    host.settings.accelerate.unlink()
    fake_gpus(host.gpus, absent=True)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] nvml" in out and "[FAIL] trainer: missing accelerate launcher" in out
    assert "no setgid bit" in out

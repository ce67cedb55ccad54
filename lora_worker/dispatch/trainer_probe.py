"""The deep check that needs the trainer itself, on this host: the trainer probe (host/trainer_probe.py: its own
interpreter in a job's sandbox and environment imports torch, sees CUDA, loads bitsandbytes), with every
configured device visible, and its answer held to what NVML shows of them.
"""
from __future__ import annotations

from typing import Any

from lora_worker.checks import Check
from lora_worker.config import Settings
from lora_worker.host.nvml import GpuReading
from lora_worker.host.trainer import trainer_env
from lora_worker.host.trainer_probe import run_probe

NAME = "trainer in the sandbox"


def trainer_check(settings: Settings, readings: list[GpuReading] | None) -> Check:
    visible = ",".join(str(i) for i in sorted(settings.devices))
    answer, problem = run_probe(settings, trainer_env(settings, visible))
    if problem is not None:
        return Check(NAME, False, problem)
    ok, detail = verdict(answer, settings, readings)
    return Check(NAME, ok, detail, simulated=bool(answer.get("simulated")))


def verdict(answer: dict[str, Any], settings: Settings, readings: list[GpuReading] | None) -> tuple[bool, str]:
    """(ok, detail) from the probe's answer."""
    if answer.get("simulated"):
        return True, (f"Python {answer.get('python')} starts in the job's sandbox and environment; torch, CUDA and "
                      "bitsandbytes simulated (the test double imports none, uses no GPU)")
    if "torch_error" in answer:
        return False, f"the trainer's interpreter cannot import torch: {answer['torch_error']}"
    head = f"torch {answer.get('torch')}"
    nvml = None if readings is None else sum(1 for r in readings if r.index in settings.devices and not r.error)
    if not answer.get("cuda"):
        return False, (f"{head} sees no CUDA device" + (": no GPU on this host (NVML has no driver)"
                       if readings is None else f" though NVML shows {nvml}") + "; nothing can train here")
    if nvml is not None and answer.get("devices") != nvml:
        return False, f"{head} sees {answer.get('devices')} CUDA device(s), NVML {nvml} of the configured ones"
    if "bitsandbytes_error" in answer:
        return False, f"{head} ok, but bitsandbytes does not load: {answer['bitsandbytes_error']}"
    return True, (f"{head}, CUDA with {answer.get('devices')} device(s), bitsandbytes "
                  f"{answer.get('bitsandbytes')}, Python {answer.get('python')}")

"""Can this host train? The deep checks behind `doctor --strict` and `GET /healthz?deep=1`.

A 200 from /healthz says the service answers; it said so on hosts where every job would crash: a bwrap that
cannot make its namespaces (Ubuntu 24.04's AppArmor rule on unprivileged user namespaces), a trainer venv
behind `/home` that the unit's ProtectHome hides, `/dev/nvidia-uvm` never created because nothing used CUDA
since boot, a torch without CUDA. Each check here is one of those, found before a job is accepted. Under Slurm
the jobs run on the cluster's nodes, so the checks are the cluster's (slurm/health.py: the controller answers, the
partition has usable nodes with each tier's GPU, and, opt-in, a probe job starts the trainer on a node); what
cannot be checked is listed under `unchecked`, and fails `doctor --strict`.

The service runs them once, in the background, at start-up (`DeepHealth`); /healthz?deep=1 only reads the
result, so a deploy gate may poll it as often as it likes. `doctor` runs them afresh.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lora_worker.backends import Backend, backend_for
from lora_worker.checks import Check
from lora_worker.config import Settings
from lora_worker.errors import NvmlUnavailable
from lora_worker.host import sandbox
from lora_worker.host.nvml import GpuReading, Nvml

log = logging.getLogger(__name__)

# What the deployed unit (systemd/lora-worker.service.in) hides from the service and so from the trainer:
# ProtectHome=yes makes these three empty and inaccessible; PrivateTmp=yes gives the unit its own empty /tmp
# and /var/tmp. A trainer installed under any of them passes a check run from a shell and fails every job.
HIDDEN_BY_UNIT: tuple[tuple[Path, str], ...] = (
    (Path("/home"), "ProtectHome=yes"), (Path("/root"), "ProtectHome=yes"), (Path("/run/user"), "ProtectHome=yes"),
    (Path("/tmp"), "PrivateTmp=yes"), (Path("/var/tmp"), "PrivateTmp=yes"))
# The nodes every CUDA process opens besides its card's /dev/nvidiaN. bwrap binds what exists; a node missing
# on the host (nvidia-uvm is made by the first CUDA program after boot, or by nvidia-modprobe) cannot be made
# inside the sandbox, where the trainer has no capability, so the job crashes on its first CUDA call.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm")
PROC_GPUS = Path("/proc/driver/nvidia/gpus")
DEV = Path("/dev")


def deep_checks(settings: Settings, nvml: Nvml, *, trainer: bool = True,
                namespaces: Callable[[Settings], str | None] | None = None,
                backend: Backend | None = None) -> list[Check]:
    """The checks that say whether a job can run where the backend of new jobs (`backend`, default the settings')
    places it: this host's own when it places them here, then the backend's (`Backend.readiness`; under Slurm, the
    cluster's). `trainer`: also start the trainer's interpreter in the sandbox (seconds: it imports torch; under
    Slurm, on a node, opt-in). `namespaces`: how the bwrap probe is asked (default: afresh)."""
    backend = backend or backend_for(settings)
    checks = host_checks(settings, nvml, trainer=trainer, namespaces=namespaces) if backend.places_here else []
    return checks + backend.readiness(settings, trainer=trainer)


def host_checks(settings: Settings, nvml: Nvml, *, trainer: bool,
                namespaces: Callable[[Settings], str | None] | None) -> list[Check]:
    """This host's: the sandbox, NVML's process lists, the device nodes, the trainer outside what the unit hides,
    and (`trainer`) the trainer probe."""
    from lora_worker.dispatch.trainer_probe import trainer_check  # it builds the job's environment

    checks = [sandbox_check(settings, namespaces or sandbox.probe)]
    readings, nvml_problem = _read(nvml)
    checks += list(process_list_checks(settings, readings, nvml_problem))
    checks.append(device_node_check(settings, readings))
    checks.append(hidden_paths_check(settings))
    if trainer:
        checks.append(trainer_check(settings, readings))
    return checks


def sandbox_check(settings: Settings, namespaces: Callable[[Settings], str | None]) -> Check:
    problem, described = namespaces(settings), sandbox.describe(settings)
    said = f"; {problem}" if problem and problem not in described else ""
    return Check("sandbox", problem is None, described + said)


def process_list_checks(settings: Settings, readings: list[GpuReading] | None,
                        problem: str | None) -> Iterator[Check]:
    """NVML must list the compute processes of every configured card: admission refuses a busy card by them,
    and a list it cannot read looks like an idle card."""
    if readings is None:
        yield Check("nvml process lists", False, f"{problem} (no GPU driver on this host: nothing can train here)")
        return
    by_index = {r.index: r for r in readings}
    for index in sorted(settings.devices):
        reading = by_index.get(index)
        name = f"nvml process list {index}"
        if reading is None:
            yield Check(name, False, f"device {index} is configured but NVML sees {len(readings)} device(s)")
        elif reading.error or reading.processes_error:
            yield Check(name, False, f"unreadable: {reading.error or reading.processes_error}")
        else:
            yield Check(name, True, f"readable ({len(reading.processes or ())} compute process(es))",
                        simulated=settings.nvml_fake_file is not None)


def device_node_check(settings: Settings, readings: list[GpuReading] | None) -> Check:
    name = f"device nodes {settings.dev_root}"
    if settings.nvml_fake_file is not None and settings.dev_root == DEV:
        return Check(name, True, "simulated GPUs (nvml_fake_file): no device nodes to look for in /dev",
                     simulated=True)
    wanted = [*CONTROL_NODES, *(f"nvidia{_minor(index, readings)}" for index in sorted(settings.devices))]
    missing = [n for n in wanted if not os.path.exists(settings.dev_root / n)]
    if missing:
        return Check(name, False, f"missing {', '.join(missing)}: the sandbox cannot create them and the job "
                     "crashes at its first CUDA call; fix: `nvidia-modprobe -u -c=0` (or run nvidia-smi and any "
                     "CUDA program once after boot), and check the driver is loaded")
    return Check(name, True, f"{', '.join(wanted)} present")


def hidden_paths_check(settings: Settings) -> Check:
    """The trainer's interpreter, its venv and sd-scripts, resolved (realpath), must lie outside what the unit
    hides: the unit's service, and so the sandbox it starts, would find nothing there."""
    launcher = settings.accelerate
    paths = [launcher, launcher.parent.parent, *sandbox.host_facts(settings).interpreter_dirs,
             settings.sd_scripts_dir, settings.tokenizer_cache_dir]
    interpreter = _shebang(launcher)
    if interpreter:
        paths.append(Path(interpreter))
    found = []
    for path in dict.fromkeys(paths):
        real = Path(os.path.realpath(path))
        for hidden, why in HIDDEN_BY_UNIT:
            if real == hidden or hidden in real.parents:
                found.append(f"{path}" + (f" (→ {real})" if real != path else "") + f" is under {hidden} ({why})")
    name = "trainer outside the unit's hidden paths"
    if found and settings.simulated:  # refused under systemd (config.refuse_simulated_when_deployed)
        return Check(name, True, "simulated: this worker never runs under the unit; under it, this would fail: "
                     + "; ".join(found[:2]), simulated=True)
    if found:
        return Check(name, False, "; ".join(found[:4]) + ": the service cannot see it; install the trainer "
                     "(and the Python its venv was made from) under /opt")
    return Check(name, True, f"{launcher} and its interpreter resolve outside "
                 f"{', '.join(str(p) for p, _ in HIDDEN_BY_UNIT)}")


class DeepHealth:
    """The deep checks, run once on a background thread (start-up must not wait seconds for torch), kept for
    /healthz?deep=1. Until they finish the answer is `pending`, which a gate reads as not yet."""

    def __init__(self, settings: Settings, nvml: Nvml, backend: Backend | None = None) -> None:
        self.settings, self.nvml, self.backend = settings, nvml, backend
        self._lock = threading.Lock()
        self._result: dict[str, Any] = {"status": "pending", "checks": [], "checked_at": None}
        self._thread: threading.Thread | None = None

    def start(self) -> DeepHealth:
        self._thread = threading.Thread(target=self.run, name="deep-health", daemon=True)
        self._thread.start()
        return self

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        try:
            checks = deep_checks(self.settings, self.nvml, namespaces=sandbox.probed_problem, backend=self.backend)
        except Exception as exc:  # noqa: BLE001 - a check that raised is a failed gate, never a dead thread
            log.exception("deep health check raised")
            checks = [Check("deep checks", False, f"raised {type(exc).__name__}: {exc}")]
        failed = [c.name for c in checks if c.failed]
        result = {"status": "failing" if failed else "ok", "failed": failed,
                  "unchecked": [c.name for c in checks if not c.checked],
                  "simulated": any(c.simulated for c in checks), "checks": [c.as_dict() for c in checks],
                  "checked_at": time.time(), "took_s": round(time.monotonic() - started, 2)}
        with self._lock:
            self._result = result
        for check in checks:
            (log.warning if check.failed else log.info)("deep health: %s", check.line())
        return result

    def wait(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def result(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._result)


def _read(nvml: Nvml) -> tuple[list[GpuReading] | None, str | None]:
    try:
        return nvml.read(), None
    except NvmlUnavailable as exc:
        return None, exc.message


def _minor(index: int, readings: list[GpuReading] | None) -> int:
    """The card's /dev/nvidiaN: the driver's minor number (from /proc), which is the PCI-order index on a host
    whose every GPU is NVIDIA's, and the index when /proc does not say."""
    reading = next((r for r in readings or [] if r.index == index), None)
    if reading is not None and reading.pci_bus_id:
        bus = reading.pci_bus_id.lower()[-12:]  # NVML's 00000000:01:00.0 → /proc's 0000:01:00.0
        try:
            text = (PROC_GPUS / bus / "information").read_text()
        except OSError:
            return index
        found = re.search(r"Device Minor:\s*(\d+)", text)
        if found:
            return int(found.group(1))
    return index


def _shebang(script: Path) -> str | None:
    try:
        with open(script, "rb") as fh:
            first = fh.readline(4096)
    except OSError:
        return None
    parts = first[2:].split() if first.startswith(b"#!") else []
    return parts[0].decode(errors="replace") if parts else None

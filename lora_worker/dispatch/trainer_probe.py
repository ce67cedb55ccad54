"""The deep check that needs the trainer itself: its own interpreter (the `#!` line of its `accelerate`), started
through the very sandbox and environment a job gets, imports torch, sees CUDA with as many devices as NVML
shows of the configured ones, and loads bitsandbytes (sd-scripts' 8-bit optimisers).

The worker never imports torch; this runs torch's interpreter in a child and reads one JSON line back.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from lora_worker.config import Settings
from lora_worker.dispatch.argv import trainer_env
from lora_worker.dispatch.readiness import Check
from lora_worker.host import sandbox
from lora_worker.host.nvml import GpuReading

MARK = "LORA-WORKER-PROBE "
TIMEOUT_S = 180.0  # a cold torch + bitsandbytes import from a spinning disk takes tens of seconds
NAME = "trainer in the sandbox"

# Run by the trainer's interpreter. bitsandbytes prints banners on stdout: the answer is the marked line.
PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = bool(torch.cuda.is_available())
    out["devices"] = torch.cuda.device_count() if out["cuda"] else 0
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    import bitsandbytes
    out["bitsandbytes"] = getattr(bitsandbytes, "__version__", "?")
except Exception as exc:
    out["bitsandbytes_error"] = f"{type(exc).__name__}: {exc}"
print("LORA-WORKER-PROBE " + json.dumps(out), flush=True)
"""
# The simulated trainer is the worker's own Python: no torch to import. It proves what it can (the sandbox
# and the interpreter start, with a job's environment) and says the rest was simulated.
SIMULATED_PROBE = r"""
import json, sys
print("LORA-WORKER-PROBE " + json.dumps({"python": sys.version.split()[0], "simulated": True}), flush=True)
"""


def trainer_check(settings: Settings, readings: list[GpuReading] | None) -> Check:
    answer, problem = run_probe(settings)
    if problem is not None:
        return Check(NAME, False, problem)
    ok, detail = verdict(answer, settings, readings)
    return Check(NAME, ok, detail, simulated=bool(answer.get("simulated")))


def run_probe(settings: Settings, timeout_s: float = TIMEOUT_S) -> tuple[dict[str, Any], str | None]:
    """The probe's answer, or why there is none (a sentence)."""
    command = _interpreter_command(settings.accelerate)
    if command is None:
        return {}, (f"{settings.accelerate} has no `#!` line naming its interpreter" if settings.accelerate.is_file()
                    else f"{settings.accelerate} is missing: no trainer to start")
    problem = sandbox.unavailable(settings)
    if problem:
        return {}, f"cannot start it: {problem}"
    done = _run_sandboxed([*command, "-c", SIMULATED_PROBE if settings.simulated else PROBE], settings, timeout_s)
    if isinstance(done, str):
        return {}, done
    lines = [line[len(MARK):] for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return {}, (f"{command[0]} exited {done.returncode} in the sandbox"
                    + (f": {said[-1][:300]}" if said else " without a word"))
    return json.loads(lines[-1]), None


def _run_sandboxed(argv: list[str], settings: Settings, timeout_s: float) -> subprocess.CompletedProcess[str] | str:
    """`argv` in a job's sandbox (an empty scratch folder for its dataset, model and output) with a job's
    environment, every configured device visible; or why it could not run."""
    scratch = Path(tempfile.mkdtemp(prefix="lw-probe-"))
    # The sandbox binds a job's directories only by the descriptors a check opened (host/sandbox.py): the scratch
    # folder is held open the same way, as the job's dataset and output both.
    held = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        job = sandbox.JobPaths(dataset_dir=scratch, base_model_path=scratch, output_dir=scratch)
        wrapped = sandbox.wrap(argv, job, settings, sandbox.host_facts(settings), {scratch: held})
        visible = ",".join(str(i) for i in sorted(settings.devices))
        return subprocess.run(wrapped, env=trainer_env(settings, visible), cwd=settings.sd_scripts_dir,  # noqa: S603
                              capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False, pass_fds=(held,))
    except subprocess.TimeoutExpired:
        return f"{argv[0]} did not answer in {timeout_s:g}s"
    except OSError as exc:
        return f"{argv[0]} cannot be started: {exc.strerror or exc}"
    finally:
        os.close(held)
        shutil.rmtree(scratch, ignore_errors=True)


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


def _interpreter_command(launcher: Path) -> list[str] | None:
    """The launcher's `#!` line as a command (`/usr/bin/env python3` stays two words)."""
    try:
        with open(launcher, "rb") as fh:
            first = fh.readline(4096)
    except OSError:
        return None
    parts = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    return parts or None

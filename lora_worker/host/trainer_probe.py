"""The trainer probe: the trainer's own interpreter (the `#!` line of its `accelerate`), started through the very
sandbox and environment a job gets, imports torch, looks for CUDA and loads bitsandbytes (sd-scripts' 8-bit
optimisers), and answers in one JSON line. The worker never imports torch; this runs torch's interpreter in a
child and reads that line back.

One probe, run where jobs run: on this host by the deep check (dispatch/trainer_probe.py, which holds the answer
to NVML's devices), and on a Slurm node by the opt-in probe job (run/node.py `--probe-trainer`, slurm/health.py).
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
from lora_worker.host import sandbox

MARK = "LORA-WORKER-PROBE "
TIMEOUT_S = 180.0  # a cold torch + bitsandbytes import from a spinning disk takes tens of seconds

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


def run_probe(settings: Settings, env: dict[str, str],
              timeout_s: float = TIMEOUT_S) -> tuple[dict[str, Any], str | None]:
    """The probe's answer, run with the job environment `env`, or why there is none (a sentence)."""
    command = _interpreter_command(settings.accelerate)
    if command is None:
        return {}, (f"{settings.accelerate} has no `#!` line naming its interpreter" if settings.accelerate.is_file()
                    else f"{settings.accelerate} is missing: no trainer to start")
    problem = sandbox.unavailable(settings)
    if problem:
        return {}, f"cannot start it: {problem}"
    done = _run_sandboxed([*command, "-c", SIMULATED_PROBE if settings.simulated else PROBE], settings, env,
                          timeout_s)
    if isinstance(done, str):
        return {}, done
    answer = answer_of(done.stdout)
    if done.returncode != 0 or answer is None:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return {}, (f"{command[0]} exited {done.returncode} in the sandbox"
                    + (f": {said[-1][:300]}" if said else " without a word"))
    return answer, None


def answer_of(stdout: str) -> dict[str, Any] | None:
    """The last marked line's JSON object, or None."""
    lines = [line[len(MARK):] for line in stdout.splitlines() if line.startswith(MARK)]
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _run_sandboxed(argv: list[str], settings: Settings, env: dict[str, str],
                   timeout_s: float) -> subprocess.CompletedProcess[str] | str:
    """`argv` in a job's sandbox (an empty scratch folder for its dataset, model and output) with a job's
    environment; or why it could not run."""
    scratch = Path(tempfile.mkdtemp(prefix="lw-probe-"))
    # The sandbox binds a job's directories only by the descriptors a check opened (host/sandbox.py): the scratch
    # folder is held open the same way, as the job's dataset and output both.
    held = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        job = sandbox.JobPaths(dataset_dir=scratch, base_model_path=scratch, output_dir=scratch)
        wrapped = sandbox.wrap(argv, job, settings, sandbox.host_facts(settings), {scratch: held})
        return subprocess.run(wrapped, env=env, cwd=settings.sd_scripts_dir,  # noqa: S603
                              capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False, pass_fds=(held,))
    except subprocess.TimeoutExpired:
        return f"{argv[0]} did not answer in {timeout_s:g}s"
    except OSError as exc:
        return f"{argv[0]} cannot be started: {exc.strerror or exc}"
    finally:
        os.close(held)
        shutil.rmtree(scratch, ignore_errors=True)


def _interpreter_command(launcher: Path) -> list[str] | None:
    """The launcher's `#!` line as a command (`/usr/bin/env python3` stays two words)."""
    try:
        with open(launcher, "rb") as fh:
            first = fh.readline(4096)
    except OSError:
        return None
    parts = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    return parts or None

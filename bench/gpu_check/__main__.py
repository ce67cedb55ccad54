"""`python -m bench.gpu_check`: the worker proved on a GPU in one command (issue #35); `--cpu` rehearses it on the
real trainer's CPU rig. What it does, in order, and the table it prints: bench/gpu_check/__init__.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from bench.gpu_check import nvml_check
from bench.gpu_check.runs import Outcome, RunSpec, rows_of, run_one
from bench.gpu_check.service import Service
from bench.gpu_check.table import Row, as_json, render, unmeasured
from bench.gpu_check.watch import Seen
from lora_worker.config import REPO_ROOT, TIERS, DeviceProfile, Settings
from lora_worker.host.nvml import Nvml, PynvmlBackend
from lora_worker.ledger.migrate import upgrade

HERE = Path(__file__).resolve().parent
VRAM_MIB = MappingProxyType({"fast": 16_000, "balanced": 16_500, "quality": 24_000})  # the 48 GB card's admission
# The runs on a GPU: both resolutions the tiers train at, each with and without a sample pass (the last one is the
# first to go when the time budget runs short). A state and a step LoRA every 20 steps, as every job saves some.
GPU_RUNS = (
    RunSpec("768 px", "fast", 768, 16, 40, 20),
    RunSpec("1024 px", "quality", 1024, 32, 40, 20),
    RunSpec("1024 px + sample", "quality", 1024, 32, 40, 20, sampled=True, sample_steps=20),
    RunSpec("768 px + sample", "fast", 768, 16, 40, 20, sampled=True, sample_steps=20),
)
# The rehearsal on the CPU rig: the same code at sizes a CPU finishes (minutes per run, mostly the model's load).
CPU_RUNS = (
    RunSpec("256 px", "fast", 256, 4, 3, 2),
    RunSpec("256 px + sample", "fast", 256, 4, 3, 2, sampled=True, sample_steps=2),
)
TRAINER_PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
for name in ("torch", "transformers", "diffusers", "accelerate", "safetensors", "bitsandbytes"):
    try:
        out[name] = __import__(name).__version__
    except Exception as exc:
        out[name] = f"not importable: {type(exc).__name__}: {exc}"
import torch
out["cuda"] = torch.version.cuda
if torch.cuda.is_available():
    out["device"] = torch.cuda.get_device_name(0)
    out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
print("GPU-CHECK " + json.dumps(out), flush=True)
"""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    p.add_argument("--cpu", action="store_true", help="rehearse on the CPU rig: tiny sizes, a simulated card")
    p.add_argument("--trainer-venv", type=Path, required=True, help="the venv sd-scripts runs in (its bin/accelerate)")
    p.add_argument("--sd-scripts", type=Path, required=True, help="sd-scripts at the pinned commit")
    p.add_argument("--tokenizers", type=Path, required=True, help="the two offline CLIP tokenizer folders")
    p.add_argument("--work", type=Path, required=True, help="state dir, train root and models go here")
    p.add_argument("--out", type=Path, default=None,
                   help="the table, JSON and logs (default: $OUT, else var/gpu-check)")
    p.add_argument("--base-model", type=Path, default=None, help="an SDXL checkpoint to use instead of building one")
    p.add_argument("--bwrap", type=Path, default=None, help="the bubblewrap executable for the sandbox")
    p.add_argument("--sandbox-none", metavar="WHY", default=None, help="no sandbox, and why (printed in the table)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for everything (GPU 420, CPU 3000), counted "
                   "from $LW_GPU_CHECK_T0 when set; a run that would not fit is skipped, and said so")
    p.add_argument("--host-note", action="append", default=[], help="what device.sh changed on the host (a row)")
    p.add_argument("--runs", default=None, help="comma-separated run names to keep (e.g. '768 px,1024 px')")
    p.add_argument("--batch-size", type=int, default=1, help="train_batch_size of the check's card profile")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    t0 = float(os.environ.get("LW_GPU_CHECK_T0") or time.time())
    deadline = time.monotonic() - (time.time() - t0) + (args.budget_s or (3000.0 if args.cpu else 420.0))
    out = args.out or Path(os.environ.get("OUT") or REPO_ROOT / "var" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    python = str(args.trainer_venv / "bin" / "python")
    rows: list[Row] = []
    gpu_why = "--cpu: the CPU rig, a simulated card (nvml_fake_file); no GPU memory to read" if args.cpu else None
    meta: dict[str, Any] = {"title": "GPU check", "card": None, "mode": "cpu rehearsal" if args.cpu else "gpu",
                            "machine": _machine(), "trainer": {}, "arguments": argv}
    outcomes: list[tuple[RunSpec, Outcome | None]] = []
    model = None
    rows += [Row("host", "device.sh", note, how="what the GPU machine's setup found or changed")
             for note in args.host_note]
    try:
        meta["trainer"] = _trainer(python, rows, deadline)
        meta["card"] = _card(args, python, rows, meta["trainer"], deadline)
        meta["title"] = f"GPU check: {meta['card']}"
        model = args.base_model or _build_model(args, python, work, rows, deadline)
        if model is not None:
            settings = _settings(args, work, model, meta["card"])
            settings.state_dir.mkdir(parents=True, exist_ok=True)
            upgrade(settings.database_path)  # as `make run` migrates the ledger first (`lora-worker migrate`)
            nvml: Nvml | None = None if args.cpu else PynvmlBackend(settings.nvml_timeout_s)
            outcomes = _runs(args, settings, model, work, nvml, deadline, rows, gpu_why)
    except Exception as exc:  # noqa: BLE001 - the table still says how far it got, and this is its last row
        rows.append(Row("check", "stopped", f"{type(exc).__name__}: {exc}", ok=False))
        raise
    finally:
        meta.update(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), seconds=round(time.time() - t0, 1))
        _write(out, work, meta, rows)
    ran = [o for _, o in outcomes if o is not None]
    return 0 if model is not None and ran and all(o.job.get("status") == "succeeded" for o in ran) else 1


def within(deadline: float, cap_s: float) -> float:
    """A step's own timeout, cut to the budget left: the device call's limit comes 60 s after the budget, and a
    check killed there writes no table, so a hang before the runs must end in time for the table to be written."""
    return max(1.0, min(cap_s, deadline - time.monotonic()))


def _trainer(python: str, rows: list[Row], deadline: float) -> dict[str, Any]:
    """The trainer interpreter's packages (and its CUDA device), as that interpreter reports them."""
    done = subprocess.run([python, "-c", TRAINER_PROBE], capture_output=True, text=True,  # noqa: S603
                          timeout=within(deadline, 300), check=False)
    lines = [line[len("GPU-CHECK "):] for line in done.stdout.splitlines() if line.startswith("GPU-CHECK ")]
    if not lines:
        rows.append(unmeasured("trainer", "packages", f"{python} exited {done.returncode}: {done.stderr[-300:]}"))
        return {}
    found: dict[str, Any] = json.loads(lines[-1])
    rows.append(Row("trainer", "packages", ", ".join(f"{k} {v}" for k, v in found.items()
                                                     if k not in ("device", "capability")),
                    how=f"imported by {python}"))
    return found


def _card(args: argparse.Namespace, python: str, rows: list[Row], trainer: dict[str, Any], deadline: float) -> str:
    """The NVML comparison (with a CUDA process of the check's own on the card) and the card's name."""
    if args.cpu:
        nvml_rows, readings, driver = nvml_check.live_rows()
        rows += nvml_rows
        rows.append(unmeasured("card", "GPU", "--cpu: the CPU rig has no GPU"))
        return f"no GPU (CPU rehearsal on {platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    with nvml_check.cuda_holder(python, timeout_s=within(deadline, 180)) as (pid, why):
        rows.append(Row(nvml_check.SECTION, "the check's CUDA process", f"pid {pid}, 1024 MiB on each device",
                        how="the trainer's torch") if pid else
                    unmeasured(nvml_check.SECTION, "the check's CUDA process", why))
        nvml_rows, readings, driver = nvml_check.live_rows()
        rows += nvml_rows
    if not readings:
        rows.append(unmeasured("card", "GPU", "NVML read no device"))
        return "no GPU seen by NVML"
    first = readings[0]
    name = f"{first.name}, {first.memory_total_mib} MiB, driver {driver or '?'}"
    rows.append(Row("card", "GPU", name + f"; torch: {trainer.get('device')} (sm {trainer.get('capability')}), CUDA "
                    f"{trainer.get('cuda')}", how="NVML / nvidia-smi / the trainer's torch"))
    return name


def _build_model(args: argparse.Namespace, python: str, work: Path, rows: list[Row], deadline: float) -> Path | None:
    device = "cpu" if args.cpu else "cuda"
    model = work / "models" / "sdxl_random.safetensors"
    log = work / "logs" / "make_sdxl.log"
    started = time.monotonic()
    with log.open("w") as fh:
        done = subprocess.run([python, str(HERE / "make_sdxl.py"), "--device", device, str(model)],  # noqa: S603
                              cwd=args.sd_scripts, stdout=fh, stderr=subprocess.STDOUT, check=False,
                              timeout=within(deadline, 3000))
    took = time.monotonic() - started
    if done.returncode != 0 or not model.exists():
        tail = log.read_text(errors="replace")[-400:]
        rows.append(unmeasured("checkpoint", "random SDXL built", f"make_sdxl.py exited {done.returncode}: {tail}"))
        return None
    rows.append(Row("checkpoint", f"random SDXL built on {device}", took, "s",
                    how=f"bench/gpu_check/make_sdxl.py: {model.stat().st_size / 1e9:.2f} GB"))
    return model


def _settings(args: argparse.Namespace, work: Path, model: Path, card: str) -> Settings:
    fake = None
    if args.cpu:  # one simulated 48 GB card: admission has something to admit the job to
        fake = work / "gpus.json"
        fake.write_text(json.dumps({"devices": [{"name": "simulated (CPU rehearsal)", "uuid": "GPU-sim-0",
                                                 "pci_bus_id": "00000000:01:00.0", "memory_total_mib": 49140,
                                                 "memory_used_mib": 0}]}))
    device = DeviceProfile(0, card[:60], frozenset(TIERS), args.batch_size, VRAM_MIB)
    return Settings(state_dir=work / "state", train_root=work / "train", model_dirs=(model.parent,),
                    accelerate=args.trainer_venv / "bin" / "accelerate", sd_scripts_dir=args.sd_scripts,
                    tokenizer_cache_dir=args.tokenizers, cpu_threads=min(8, os.cpu_count() or 2),
                    nvml_fake_file=fake, devices=MappingProxyType({0: device}),
                    sandbox="none" if args.sandbox_none else "bwrap", bwrap_path=args.bwrap)


def _runs(args: argparse.Namespace, settings: Settings, model: Path, work: Path, nvml: Nvml | None, deadline: float,
          rows: list[Row], gpu_why: str | None) -> list[tuple[RunSpec, Outcome | None]]:
    specs = [s for s in (CPU_RUNS if args.cpu else GPU_RUNS)
             if args.runs is None or s.name in [n.strip() for n in args.runs.split(",")]]
    done: list[tuple[RunSpec, Outcome | None]] = []
    estimate = 600.0 if args.cpu else 120.0
    if args.sandbox_none:
        rows.append(Row("deep health", "sandbox for the runs", "none", how=args.sandbox_none))
    for i, spec in enumerate(specs):
        left = deadline - time.monotonic()
        if left < estimate:
            rows.append(unmeasured(f"run {spec.name}", "job", f"skipped: {left:.0f} s of the time budget left, a run "
                                   f"took {estimate:.0f} s"))
            done.append((spec, None))
            continue
        try:
            outcome, settings = _run(spec, i == 0, args, settings, model, work, nvml, deadline, rows)
        except Exception as exc:  # noqa: BLE001 - one run that breaks is a failed row; the others still run
            rows.append(Row(f"run {spec.name}", "job", f"the check broke: {type(exc).__name__}: {exc}", ok=False))
            done.append((spec, Outcome({"status": "broke"}, [], Seen(), None, 0.0)))
            continue
        estimate = outcome.wall_s * 1.2
        rows += rows_of(spec, outcome, gpu_why=gpu_why)
        if i == 0:
            keys = outcome.seen.keys_matched
            rows.append(Row("checkpoint", "sd-scripts loaded it", f"{keys} of 4 `All keys matched`", ok=keys == 4,
                            how="the first run's log"))
        done.append((spec, outcome))
    return done


def _run(spec: RunSpec, first: bool, args: argparse.Namespace, settings: Settings, model: Path, work: Path,
         nvml: Nvml | None, deadline: float, rows: list[Row]) -> tuple[Outcome, Settings]:
    """The run's service (its tier sizes), the deep checks on the first, the job; the service stopped after."""
    svc = Service(settings.with_overrides(rig_tier_sizes={spec.tier: spec.sizes()}), work / "logs",
                  spec.name.replace(" ", "").replace("+", "-"), deep=first).start()
    try:
        if first:
            svc, settings = _deep_health(svc, settings, spec, work, rows, args, deadline)
        return run_one(spec, svc, model, work, nvml=nvml, images=3 if args.cpu else 4,
                       image_size=256 if args.cpu else 1024, deadline=deadline), settings
    finally:
        svc.stop()


def _deep_health(svc: Service, settings: Settings, spec: RunSpec, work: Path, rows: list[Row],
                 args: argparse.Namespace, deadline: float) -> tuple[Service, Settings]:
    """The service's start-up deep checks (GET /healthz?deep=1), as rows; on a GPU whose sandbox cannot start, the
    runs go on without it (said so) rather than not at all."""
    deep = svc.deep_health(timeout_s=within(deadline, 300))
    checks = deep.get("checks") or []
    if not checks:
        rows.append(unmeasured("deep health", "checks", f"no answer: {deep}"))
    for check in checks:
        rows.append(Row("deep health", check["name"], check["detail"], ok=bool(check["ok"]) or not check["required"],
                        how="GET /healthz?deep=1" + (" (simulated)" if check.get("simulated") else "")))
    sandbox = next((c for c in checks if c["name"] == "sandbox"), None)
    if args.cpu or settings.sandbox == "none" or sandbox is None or sandbox["ok"]:
        return svc, settings
    svc.stop()
    settings = settings.with_overrides(sandbox="none")
    rows.append(Row("deep health", "sandbox for the runs", "none", how=f"bwrap failed here: {sandbox['detail']}"))
    return Service(settings.with_overrides(rig_tier_sizes={spec.tier: spec.sizes()}), work / "logs",
                   "nosandbox", deep=False).start(), settings


def _machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / (1 << 30), 1), "kernel": platform.release(),
            "python": platform.python_version(), "processor": platform.processor() or platform.machine()}


def _write(out: Path, work: Path, meta: dict[str, Any], rows: list[Row]) -> None:
    table = render(meta["title"] + f" ({meta['date']}, {meta['mode']})", rows)
    print(table, flush=True)
    (out / "gpu-check.md").write_text(table)
    (out / "gpu-check.json").write_text(json.dumps(as_json(meta, rows), indent=2) + "\n")
    with tarfile.open(out / "gpu-check-logs.tar.gz", "w:gz") as tar:  # the runs' logs, for what went wrong
        for path in sorted((work / "logs").glob("*")) + sorted((work / "state" / "logs").glob("job-*")):
            if path.is_file():
                tar.add(path, arcname=path.name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

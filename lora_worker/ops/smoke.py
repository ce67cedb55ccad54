"""`lora-worker smoke`: one real training per configured device, through the running service's API, its
supervisor and sandbox, on a tiny generated dataset; run it once after the first deploy, with the GPUs free.

Each job must end `succeeded` with a LoRA whose bytes hash to what the supervisor verified. Per device it reports
the time per optimizer step, the peak memory NVML showed in use on the card while the job ran (sampled twice a
second), and the job's wall time. On simulated GPUs or without NVML it says that no GPU was used.

The API's smallest size is the `fast` tier (its steps and resolution are fixed by config.TIERS: a client may not
choose them), so that is what it trains: minutes on a real card, not seconds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time
import urllib.error
import urllib.request
import zlib
from datetime import datetime, UTC
from pathlib import Path
from typing import Any, TextIO

from lora_worker.config import Settings
from lora_worker.errors import ConfigError, NvmlUnavailable
from lora_worker.host.nvml import Nvml, make_nvml
from lora_worker.states import TERMINAL_STATES

IMAGES, SIZE, TIER = 4, 512, "fast"
TRIGGER, SUBJECT = "lwsmoke", "test pattern"
SAMPLE_S = 0.5
TERMINAL = {s.value for s in TERMINAL_STATES}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    smoke = sub.add_parser("smoke", help="train a tiny generated dataset on each configured device through the API")
    smoke.add_argument("--url", default=None, help="the service (default: http://<the `bind` setting>)")
    smoke.add_argument("--base-model", type=Path, default=None,
                       help="the SDXL checkpoint (default: the only .safetensors in the models dirs)")
    smoke.add_argument("--device", type=int, action="append", default=None, help="only this device (repeatable)")
    smoke.add_argument("--timeout", type=float, default=3600.0, help="seconds each job may take")
    smoke.add_argument("--token-file", default=None,
                       help="the API token (`-`: read it from stdin, e.g. `< /etc/lora-worker/api_token` as root)")


def run(settings: Settings, args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    url = (args.url or f"http://{settings.bind.split(',')[0].strip()}").rstrip("/")
    model = args.base_model or _only_model(settings)
    devices = args.device or sorted(settings.devices)
    nvml = make_nvml(settings.nvml_timeout_s, settings.nvml_fake_file)
    token = api_token(settings, args.token_file)
    started = time.monotonic()
    out.write(f"smoke: {url}, base model {model}, tier {TIER}, {IMAGES} generated {SIZE} px images, "
              f"device(s) {', '.join(map(str, devices))}\n")
    results = [_one(settings, url, token, model, index, nvml, args.timeout, out) for index in devices]
    gpu = _gpu_note(settings, nvml)
    passed = sum(results)
    out.write(f"smoke: {passed}/{len(results)} device(s) trained a verified LoRA in "
              f"{time.monotonic() - started:.1f} s wall" + (f"; {gpu}" if gpu else "") + "\n")
    return 0 if passed == len(results) else 1


def _one(settings: Settings, url: str, token: str | None, model: Path, index: int, nvml: Nvml,
         timeout_s: float, out: TextIO) -> bool:
    train_dir = settings.train_root / f"smoke-{datetime.now(UTC):%Y%m%dT%H%M%S}-d{index}"
    dataset = write_dataset(train_dir)
    body = {"dataset_dir": str(dataset), "base_model_path": str(model), "output_dir": str(train_dir / "output"),
            "output_name": "smoke", "trigger": TRIGGER, "subject_class": SUBJECT, "repeats": 1, "tier": TIER,
            "device_index": index, "seed": 1}
    started = time.monotonic()
    status, job = _request(url, "POST", "/train", token, body)
    if status != 202:
        out.write(f"device {index}: refused, {status} {job.get('error')}: {job.get('message')}\n")
        return False
    job_id = job["worker_job_id"]
    baseline, peak = _used_mib(nvml, index), None
    while job["status"] not in TERMINAL and time.monotonic() - started < timeout_s:
        time.sleep(SAMPLE_S)
        used = _used_mib(nvml, index)
        peak = used if peak is None or (used is not None and used > peak) else peak
        _, job = _request(url, "GET", f"/train/{job_id}", token)
    wall = time.monotonic() - started
    if job["status"] != "succeeded":
        out.write(f"device {index}: job {job_id} {job['status']} after {wall:.1f} s "
                  f"({job.get('failure_class')}: {job.get('error')}); `lora-worker jobs log {job_id}`\n")
        return False
    problem = verify_lora(job)
    vram = f"peak {peak} MiB in use (before: {baseline} MiB)" if peak is not None else "VRAM not readable"
    out.write(f"device {index}: job {job_id} {'succeeded' if problem is None else 'FAILED'}, "
              f"{job['total_steps']} steps, {_step_s(job)} per step, {vram}, {wall:.1f} s wall; "
              + (problem or f"LoRA {job['lora_path']} ({job['lora_size']} bytes, sha256 {job['lora_sha256'][:12]}… "
                 "verified)") + "\n")
    return problem is None


def verify_lora(job: dict[str, Any]) -> str | None:
    """Why the LoRA on disk is not the one the supervisor verified, or None. Read without following a link."""
    try:
        fd = os.open(job["lora_path"], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, TypeError) as exc:
        return f"the LoRA {job.get('lora_path')} cannot be opened: {exc}"
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as fh:
        head = fh.read(8)
        digest.update(head)
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    if len(head) < 8 or struct.unpack("<Q", head)[0] <= 0:
        return "the LoRA is not a safetensors file"
    if digest.hexdigest() != job.get("lora_sha256"):
        return f"the LoRA's sha256 {digest.hexdigest()[:12]}… is not the verified {str(job.get('lora_sha256'))[:12]}…"
    return None


def write_dataset(train_dir: Path) -> Path:
    """`<train_dir>/dataset/1_lwsmoke test pattern/` with IMAGES generated RGB images and their captions."""
    folder = train_dir / "dataset" / f"1_{TRIGGER} {SUBJECT}"
    folder.mkdir(parents=True)
    for i in range(IMAGES):
        (folder / f"pattern{i}.png").write_bytes(_png(SIZE, i))
        (folder / f"pattern{i}.txt").write_text(f"{TRIGGER} {SUBJECT}, stripes {i + 1}\n")
    return train_dir / "dataset"


def _png(size: int, seed: int) -> bytes:
    """An RGB PNG of coloured diagonal stripes, different for each seed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    def row(y: int) -> bytes:
        return b"\0" + b"".join(bytes(((x + y) * (seed + 1) % 256, (x * 3 + seed * 60) % 256, y * 2 % 256))
                                for x in range(size))
    raw = b"".join(row(y) for y in range(size))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _only_model(settings: Settings) -> Path:
    found = sorted(p for d in settings.model_dirs if d.is_dir() for p in d.rglob("*.safetensors") if p.is_file())
    if len(found) != 1:
        raise ConfigError(f"{len(found)} checkpoints in {', '.join(map(str, settings.model_dirs))}; "
                          "name the SDXL one with --base-model")
    return found[0]


def api_token(settings: Settings, given: str | None) -> str | None:
    """The API token: from `given` (a file, or `-` for stdin), else the service's credential or `api_token_file`."""
    if given == "-":
        return sys.stdin.readline().strip() or None
    if given is not None:
        return Path(given).read_text().strip() or None
    credentials = os.environ.get("CREDENTIALS_DIRECTORY")
    path = Path(credentials) / "api_token" if credentials else settings.api_token_file
    if path is None or not path.exists():
        return None
    return path.read_text().strip() or None


def _request(url: str, method: str, path: str, token: str | None, body: Any = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - the operator's own service
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _used_mib(nvml: Nvml, index: int) -> int | None:
    try:
        reading = next((r for r in nvml.read() if r.index == index), None)
    except NvmlUnavailable:
        return None
    return reading.memory_used_mib if reading is not None else None


def _step_s(job: dict[str, Any]) -> str:
    start, end, steps = job.get("training_started_at"), job.get("finished_at"), job.get("total_steps") or 0
    if not (start and end and steps):
        return "? s"
    seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    return f"{seconds / steps:.3f} s"


def _gpu_note(settings: Settings, nvml: Nvml) -> str | None:
    if settings.nvml_fake_file is not None:
        what = "the simulated trainer and " if settings.simulated else ""
        return f"no GPU was used: {what}simulated GPUs ({settings.nvml_fake_file}); the VRAM figures are that file's"
    try:
        nvml.read()
    except NvmlUnavailable:
        return "no GPU was used: NVML is not available on this host"
    return "simulated trainer: nothing was learned" if settings.simulated else None

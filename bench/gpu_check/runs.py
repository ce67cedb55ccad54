"""One run of the real worker: its service started with the run's tier sizes, a job POSTed over HTTP, followed by
long poll to its end while watch.py samples the card, the processes and the log; then the run's rows.

Where each figure comes from:
- seconds per step: the trainer's last `steps` bar in the run log (its mean over the run: sd-scripts' bar has
  smoothing=0, and pauses over a sample pass); beside it the worker's own `rate` (its recent window, what its ETA
  uses); and the whole training phase from the ledger (finished_at - training_started_at, over the steps: saves
  and sample passes included);
- the pre-training phase: started_at to training_started_at (the ledger), and each phase as the long poll saw
  it change (within the poll's latency, milliseconds);
- VRAM: NVML's memory in use on the card, five times a second, less what was in use before the POST;
- a sample pass: from its `generating sample images at step N` line (as the check saw it appear in the run log)
  to the newest image of that step on disk (its mtime), and the peak VRAM in between;
- CPU: watch.py.
"""
from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.gpu_check.service import Service
from bench.gpu_check.table import Row, unmeasured
from bench.gpu_check.watch import Seen, Watcher
from lora_worker.host.nvml import Nvml
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database

TERMINAL = ("succeeded", "failed", "cancelled")
PRE_TRAINING = ("launching", "loading_model", "caching_latents", "caching_text_encoder_outputs",
                "preparing_training")
TRIGGER, SUBJECT = "ohwx", "dog"


@dataclass(frozen=True)
class RunSpec:
    name: str  # `768 px`, `1024 px + sample`
    tier: str  # the tier whose sizes the run replaces (rig_tier_sizes)
    resolution: int
    network_dim: int
    steps: int
    save_every: int  # a state and a step LoRA every N steps, as every job has (N >= 2)
    # A sample pass before the first step and at each save, as any job with samples has (docs/samples.md): the
    # request's one prompt at the run's resolution, `sample_steps` sampler steps (the rig sizes' `sample_steps`).
    sampled: bool = False
    sample_steps: int = 20

    def sizes(self) -> dict[str, int]:
        sizes = {"max_train_steps": self.steps, "network_dim": self.network_dim, "resolution": self.resolution,
                 "save_every_n_steps": self.save_every}
        return sizes | ({"sample_steps": self.sample_steps} if self.sampled else {})

    def samples(self) -> list[dict[str, Any]]:
        """The request's `samples`: its one prompt, or none (a job that leaves the field out draws a default one)."""
        return [{"prompt": f"{TRIGGER} {SUBJECT}, sitting on grass", "seed": 42}] if self.sampled else []


def write_dataset(train_dir: Path, images: int, size: int, repeats: int) -> Path:
    """`<train_dir>/dataset/<repeats>_ohwx dog/` with `images` generated PNGs of `size` px and their captions."""
    folder = train_dir / "dataset" / f"{repeats}_{TRIGGER} {SUBJECT}"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(images):
        (folder / f"img{i}.png").write_bytes(png(size, i))
        (folder / f"img{i}.txt").write_text(f"{TRIGGER} {SUBJECT}, pattern {i}\n")
    return train_dir / "dataset"


def png(size: int, seed: int) -> bytes:
    """An RGB PNG of coloured diagonal bands, different for each seed (the VAE needs pixels, not a subject)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    palette = bytes((i * (seed + 3)) % 256 for i in range(3 * 2 * size))
    rows = b"".join(b"\0" + palette[(y * 3) % (3 * size):][:3 * size] for y in range(size))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 1)) + chunk(b"IEND", b""))


@dataclass
class Outcome:
    job: dict[str, Any]
    phases: list[tuple[str, float]]  # (phase, time.time() the long poll first saw it)
    seen: Seen
    baseline_mib: int | None
    wall_s: float


def run_one(spec: RunSpec, svc: Service, model: Path, work: Path, *, nvml: Nvml | None, images: int, image_size: int,
            deadline: float) -> Outcome:
    """Dispatch the run's job on the running service and follow it to its end (cancelled past `deadline`)."""
    settings = svc.settings
    train_dir = settings.train_root / f"gc-{spec.name.replace(' ', '').replace('+', '-')}-{int(time.time())}"
    repeats = min(100, max(1, -(-spec.steps // images)))
    dataset = write_dataset(train_dir, images, image_size, repeats)
    output = train_dir / "output"
    output.mkdir(parents=True)
    body = {"dataset_dir": str(dataset), "base_model_path": str(model), "output_dir": str(output),
            "output_name": "gc", "trigger": TRIGGER, "subject_class": SUBJECT, "repeats": repeats,
            "tier": spec.tier, "device_index": 0, "seed": 42, "samples": spec.samples()}
    started = time.monotonic()
    baseline = _used(nvml)
    code, answer = svc.request("POST", "/train", body)
    if code != 202:
        return Outcome({"status": "refused", "error": f"POST /train answered {code}: {answer}"}, [], Seen(), baseline,
                       time.monotonic() - started)
    job_id = int(answer["worker_job_id"])
    watcher = Watcher(svc.processes(), settings.log_dir / f"job-{job_id}.log", nvml, 0).start()
    db = Database.open(settings.database_path)
    try:
        job, phases = _follow(svc, db, watcher, job_id, deadline)
    finally:
        seen = watcher.stop()
        db.dispose()
    return Outcome(job, phases, seen, baseline, time.monotonic() - started)


def _follow(svc: Service, db: Database, watcher: Watcher, job_id: int,
            deadline: float) -> tuple[dict[str, Any], list[tuple[str, float]]]:
    phases: list[tuple[str, float]] = []
    version, cancelled = 0, False
    while True:
        code, job = svc.request("GET", f"/train/{job_id}?since={version}&wait=5")
        now = time.time()
        if code != 200:
            raise RuntimeError(f"GET /train/{job_id} answered {code}: {job}")
        version = job["version"]
        if job.get("phase") and (not phases or phases[-1][0] != job["phase"]):
            phases.append((job["phase"], now))
        if watcher.supervisor_pid is None and (row := repo.find_job(db, job_id)) is not None:
            watcher.supervisor_pid = row.supervisor_pid
        if job["status"] in TERMINAL:
            return job, phases
        if time.monotonic() > deadline and not cancelled:
            svc.request("POST", f"/train/{job_id}/cancel")
            cancelled = True


def _used(nvml: Nvml | None) -> int | None:
    if nvml is None:
        return None
    try:
        reading = next((r for r in nvml.read() if r.index == 0), None)
    except Exception:  # noqa: BLE001 - no baseline is a row saying so
        return None
    return reading.memory_used_mib if reading is not None else None


# -- the run's rows ------------------------------------------------------------------------------------------

def rows_of(spec: RunSpec, out: Outcome, *, gpu_why: str | None) -> list[Row]:
    """`gpu_why`: why NVML figures are not the card's (None on a real GPU)."""
    job, section = out.job, f"run {spec.name}"
    ok = job.get("status") == "succeeded"
    what = (f"{job.get('status')}" + ("" if ok else f" ({job.get('failure_class')}: {job.get('error')})")
            + f"; {spec.steps} steps, dim {spec.network_dim}, tier `{spec.tier}`")
    rows = [Row(section, "job", what, ok=ok, how=f"POST /train, GET /train/<id>; {out.wall_s:.0f} s wall")]
    if job.get("status") == "refused":
        return rows
    rows += _step_rows(section, job, out.seen)
    rows += _phase_rows(section, job, out.phases, sampled=spec.sampled)
    rows += _vram_rows(section, out, gpu_why)
    if spec.sampled:
        rows += _sample_rows(section, spec, out, gpu_why)
    rows += _cpu_rows(section, out.seen)
    return rows


def _step_rows(section: str, job: dict[str, Any], seen: Seen) -> list[Row]:
    rows = []
    rows.append(Row(section, "seconds per step", 1 / seen.bar_rate, "s", how="the trainer's last `steps` bar: its "
                    "mean over the run (smoothing=0), sample passes left out (sd-scripts pauses it)")
                if seen.bar_rate else unmeasured(section, "seconds per step", "no `steps` bar in the run log"))
    rate = job.get("rate")
    rows.append(Row(section, "  as the worker measured it", 1 / rate, "s", how="GET /train/<id> `rate`: its "
                    "recent window, the first step left out, sample passes in (what its ETA uses)") if rate else
                unmeasured(section, "  as the worker measured it", "the job reported no rate"))
    span = _seconds(job.get("training_started_at"), job.get("finished_at"))
    steps = job.get("step") or 0
    rows.append(Row(section, "training phase per step", span / steps, "s",
                    how=f"ledger: first step to the end, {span:.1f} s over {steps} steps, saves included")
                if span is not None and steps else
                unmeasured(section, "training phase per step", "the ledger has no training start or end"))
    return rows


def _phase_rows(section: str, job: dict[str, Any], phases: list[tuple[str, float]], sampled: bool) -> list[Row]:
    pre = _seconds(job.get("started_at"), job.get("training_started_at"))
    note = "; the sample pass at step 0 is in it (phase sampling, before the first step)" if sampled else ""
    rows = [Row(section, "pre-training phase", pre, "s", how="ledger: started_at to training_started_at" + note)
            if pre is not None else unmeasured(section, "pre-training phase", "the ledger has no training start")]
    for (phase, at), (_, until) in zip(phases, phases[1:]):
        if phase in PRE_TRAINING:
            rows.append(Row(section, f"  {phase}", until - at, "s", how="the long poll's view of the phase"))
    return rows


def _vram_rows(section: str, out: Outcome, gpu_why: str | None) -> list[Row]:
    if gpu_why is not None:
        return [unmeasured(section, "peak VRAM", gpu_why)]
    peak = out.seen.peak_mib()
    if peak is None:
        return [unmeasured(section, "peak VRAM", out.seen.nvml_error or "NVML gave no reading during the run")]
    base = out.baseline_mib or 0
    return [Row(section, "peak VRAM", peak - base, "MiB",
                how=f"NVML memory in use, {len(out.seen.vram)} readings: peak {peak} less {base} before the POST")]


def _sample_rows(section: str, spec: RunSpec, out: Outcome, gpu_why: str | None) -> list[Row]:
    images = sorted((out.job.get("output_dir") and Path(out.job["output_dir"], "sample").glob("*.png")) or [])
    starts = out.seen.sample_starts
    if not starts:
        return [unmeasured(section, "sample pass", "no `generating sample images` line in the run log")]
    rows = []
    for step, started in sorted(starts.items()):
        tag = f"_e{0:06d}_" if step == 0 else f"_{step:06d}_"
        done = [p.stat().st_mtime for p in images if tag in p.name]
        name = f"sample pass at step {step} ({spec.resolution} px, {spec.sample_steps} sampler steps)"
        if not done:
            rows.append(unmeasured(section, name, "its start was logged but no image of it is on disk"))
            continue
        rows.append(Row(section, name, max(done) - started, "s",
                        how="its log line (as seen, ±0.2 s) to its image's mtime"))
        if gpu_why is None:
            peak = out.seen.peak_mib(started, max(done))
            rows.append(Row(section, "  its peak VRAM", peak - (out.baseline_mib or 0), "MiB", how="NVML")
                        if peak is not None else unmeasured(section, "  its peak VRAM", "no NVML reading in it"))
    return rows


def _cpu_rows(section: str, seen: Seen) -> list[Row]:
    worker, trainer = seen.worker_cpu_s, seen.trainer_cpu_s
    if trainer <= 0:
        return [unmeasured(section, "CPU", "no trainer process was seen")]
    supervisor = seen.supervisor_cpu_s
    return [Row(section, "CPU: gunicorn / supervisor / trainer",
                f"{worker - supervisor:.1f} s / {supervisor:.1f} s / {trainer:.1f} s",
                how="the web processes (from the POST) / the job's supervisor / every process under it"),
            Row(section, "worker's CPU share", 100 * worker / (worker + trainer), "%",
                how="gunicorn and the supervisor, of all three together, with the check long-polling the job")]


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()

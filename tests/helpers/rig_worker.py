"""What the rig's tests through the worker share (tests/rig/test_real_resume.py, test_real_resume_epoch.py,
test_real_samples.py): a worker over the rig's trainer, the run logs' bars, the kill after a state, the resume
through the API, and the report of each attempt."""
from __future__ import annotations

import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lora_worker.config import Settings
from lora_worker.host import sandbox
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from tests.helpers import fake_gpus, wait_for
from tests.helpers.ledger import migrated_ledger
from tests.helpers.runs import wait_state

BAR = re.compile(r"steps:[^|\n\r]*\|[^|\n\r]*\| (\d+)/(\d+)")
KEY_LINES = re.compile(r"(resume training from.*|load train state from.*|skipping \d+ steps.*|saving state at step \d+"
                       r"|removing old state.*|saving last state\.|model saved\.|total optimization steps.*"
                       r"|Could not load random states|All \w+ (?:states|weights) loaded successfully)")


@contextmanager
def rig_worker(rig: Path, root: Path, train_id: str, folder: str, sizes: dict[str, Any],
               **request: Any) -> Iterator[tuple[Settings, Any, Database, dict[str, Any]]]:
    """A worker (its app's test client, its ledger) over the rig's real trainer, with `sizes` as the fast tier's
    rig sizes, the rig's three images copied to `<root>/train/<train_id>/dataset/<folder>`, and the body of a
    request for them (`request` overrides it). No sample prompts unless `request` names some: a sample pass on
    the CPU costs minutes, and only the samples' own test wants them."""
    dataset = root / "train" / train_id / "dataset"
    shutil.copytree(rig / "data/img/2_ohwx dog", dataset / folder)
    settings = Settings(
        state_dir=root / "state", train_root=root / "train", model_dirs=(rig / "models",),
        accelerate=rig / "venv/bin/accelerate", sd_scripts_dir=rig / "sd-scripts",
        tokenizer_cache_dir=rig / "tokenizers", cpu_threads=2, nvml_fake_file=fake_gpus(root / "gpus.json"),
        sandbox="bwrap" if sandbox.bwrap_executable() else "none", progress_interval_s=0.5,
        rig_tier_sizes={"fast": sizes})
    migrated_ledger(settings.database_path)
    from lora_worker import create_app
    app = create_app(settings)
    app.config["TESTING"] = True
    db = Database.open(settings.database_path)
    body = {"dataset_dir": str(dataset), "base_model_path": str(rig / "models/sdxl_random.safetensors"),
            "output_dir": str(dataset.parent / "output"), "output_name": "ohwx", "trigger": "ohwx",
            "subject_class": "dog", "repeats": int(folder.split("_", 1)[0]), "tier": "fast", "device_index": 0,
            "seed": 42, "samples": [], **request}
    try:
        yield settings, app.test_client(), db, body
    finally:
        db.dispose()
        app.extensions["lora_worker"].db.dispose()


def log_of(settings: Settings, job_id: int) -> str:
    path = settings.log_dir / f"job-{job_id}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def bar_steps(settings: Settings, job_id: int) -> int:
    """The optimizer steps the trainer's bar counted in this attempt's run log (its highest redraw)."""
    return max((int(n) for n, _ in BAR.findall(log_of(settings, job_id))), default=0)


def bar_totals(settings: Settings, job_id: int) -> set[int]:
    return {int(total) for _, total in BAR.findall(log_of(settings, job_id))}


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())}Z] {text}", flush=True)


def kill_after_state(client, db: Database, job_id: int, step: int) -> None:
    """Wait until the worker has judged the step LoRA of `step` (it does so once a redraw follows the save, and
    the state is saved between the step LoRA and that redraw: sd-scripts-resume.md section 1, so the state is then
    whole and the older one gone), then SIGKILL the trainer's whole process group, as a kill or reboot would. The
    run log is no trigger: it copies an open bar only every few seconds (transcript/logfile.py)."""
    def judged() -> bool:
        rows = client.get(f"/train/{job_id}").get_json()["checkpoints"]
        return any(c["step"] == step and c["verified"] is not None for c in rows)
    wait_for(judged, timeout=1800, interval=0.2, what=f"job {job_id}: the state of step {step}, complete")
    pgid = repo.get_job(db, job_id).trainer_pid
    assert pgid
    say(f"job {job_id}: state {step} complete; SIGKILL to process group {pgid}")
    os.killpg(pgid, signal.SIGKILL)
    done = wait_state(client, job_id, "failed", "succeeded", timeout=120)
    assert (done["status"], done["failure_class"]) == ("failed", "killed_by_signal"), done


def resume(client, job_id: int, expect_step: int) -> int:
    verdict = client.get(f"/train/{job_id}/resume").get_json()
    say(f"GET /train/{job_id}/resume -> {verdict}")
    assert verdict["resumable"] and verdict["from_step"] == expect_step, verdict
    answer = client.post(f"/train/{job_id}/resume", headers={"Idempotency-Key": f"rig-resume-{job_id}"})
    say(f"POST /train/{job_id}/resume -> {answer.status_code} {answer.get_json()}")
    assert answer.status_code == 202, answer.get_json()
    return int(answer.get_json()["worker_job_id"])


def report(settings: Settings, client, db: Database, jobs: list[int]) -> None:
    for job_id in jobs:
        body = client.get(f"/train/{job_id}").get_json()
        row = repo.get_job(db, job_id)
        pre = (row.training_started_at - row.started_at).total_seconds() \
            if row.training_started_at and row.started_at else None
        say(f"job {job_id}: " + ", ".join(f"{k}={body.get(k)}" for k in (
            "status", "failure_class", "step", "total_steps", "attempt", "resumed_from", "resume_step",
            "lora_sha256", "checkpoints")))
        say(f"job {job_id}: started_at={row.started_at} training_started_at={row.training_started_at} "
            f"finished_at={row.finished_at}: pre-training phase {pre} s; bar steps {bar_steps(settings, job_id)}")
        for event in repo.job_events(db, job_id):
            say(f"  event {event.at} {event.from_status}->{event.to_status} {event.actor}: {event.reason}")
        for line in KEY_LINES.findall(log_of(settings, job_id)):
            say(f"  log: {line.strip()}")

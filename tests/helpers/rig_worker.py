"""What the rig's tests through the worker share (tests/rig/test_real_resume.py, test_real_resume_epoch.py): the
run logs' bars, the kill after a state, the resume through the API, and the report of each attempt."""
from __future__ import annotations

import os
import re
import signal
import time

from lora_worker.config import Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from tests.helpers import wait_for
from tests.helpers.runs import wait_state

BAR = re.compile(r"steps:[^|\n\r]*\|[^|\n\r]*\| (\d+)/(\d+)")
KEY_LINES = re.compile(r"(resume training from.*|load train state from.*|skipping \d+ steps.*|saving state at step \d+"
                       r"|removing old state.*|saving last state\.|model saved\.|total optimization steps.*"
                       r"|Could not load random states|All \w+ (?:states|weights) loaded successfully)")


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

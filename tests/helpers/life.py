"""A worker of one backend, driven the same way whatever the backend, and the end of a job as every backend must
record it: what the contract suite (tests/contract/test_job_life.py) compares.

- "local": the app with the real launcher, the detached supervisor, the fake `accelerate` and trainer;
- "slurm": the app with `backend = "slurm"`, the fake Slurm's command-line tools (tests/slurm/fake_slurm: sbatch
  runs the batch script, the node runs the fake trainer) and the real detached poller;
- "cluster": the same against the real single-node Slurm (tests/cluster/cluster.py), where it runs.
Both with webhooks on (a receiver on loopback, every event type), so each change leaves its body in the outbox.
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_worker.config import DEFAULT_STALL_LIMITS_S
from lora_worker.host.locks import lock_state
from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.samples import SAMPLE
from lora_worker.slurm.process import beat_path, poller_lock_path
from lora_worker.webhooks.process import stop_sender
from tests.helpers import Host, Launches, pid_alive, set_modes, wait_for
from tests.helpers.ledger import migrated_ledger
from tests.helpers.runs import TERMINAL
from tests.slurm.fakes import install_fake_slurm

BACKENDS = ("local", "slurm")
TIMEOUT_S = 60.0
# Every phase of a run that reached training, as the job's events and its job.phase webhooks name them: with the
# request's default prompt, a sample pass before the first step (the base model's look).
TO_TRAINING = ("loading_model", "caching_latents", "caching_text_encoder_outputs", "preparing_training", "sampling",
               "training")


@dataclass
class Worker:
    """One backend's worker: an app (its test client), its ledger, its settings."""

    backend: str
    host: Host
    settings: Any
    client: Any
    db: Database
    app: Any
    cluster: Any = None  # the real cluster's tests/cluster/cluster.py Cluster, for "cluster"
    submitted: list[int] = field(default_factory=list)

    # -- driving a job ----------------------------------------------------------------------------------

    def modes(self, **values: Any) -> None:
        """The fake trainer's modes (tests/fakes/sdxl_train_network.py). Its steps take 10 ms: a step LoRA lives
        1.5 s between its save and its pruning, time enough for a loaded machine's follower to verify it."""
        set_modes(self.host.sd_scripts, record=str(self.host.root / "record.json"), **{"step_s": 0.01, **values})

    def submit(self, **overrides: Any) -> int:
        answer = self.client.post("/train", json=self.host.payload(**overrides))
        assert answer.status_code == 202, answer.get_json()
        self.submitted.append(answer.get_json()["worker_job_id"])
        return self.submitted[-1]

    def job(self, job_id: int) -> dict:
        return self.client.get(f"/train/{job_id}").get_json()

    def wait(self, job_id: int, what: str, test: Any, timeout: float = TIMEOUT_S) -> dict:
        def found() -> dict | None:
            row = self.job(job_id)
            return row if test(row) else None
        return wait_for(found, timeout=timeout, what=what)

    def wait_end(self, job_id: int, timeout: float = TIMEOUT_S) -> dict:
        return self.wait(job_id, f"job {job_id} to end", lambda j: j["status"] in TERMINAL, timeout)

    def wait_phase(self, job_id: int, phase: str) -> dict:
        return self.wait(job_id, f"phase {phase}", lambda j: j["phase"] == phase and j["status"] == "running")

    def cancel(self, job_id: int) -> None:
        assert self.client.post(f"/train/{job_id}/cancel").status_code == 202

    def log(self, job_id: int) -> bytes:
        return (self.settings.log_dir / f"job-{job_id}.log").read_bytes()

    def follower_pid(self, job_id: int) -> int:
        """The process following the job: its supervisor, or the Slurm poller."""
        if self.backend == "local":
            pid = repo.get_job(self.db, job_id).supervisor_pid
        else:
            pid = lock_state(poller_lock_path(self.settings)).holder_pid
        assert pid is not None
        return pid

    def signal_follower(self, job_id: int, sig: int) -> int:
        pid = self.follower_pid(job_id)
        os.kill(pid, sig)
        wait_for(lambda: not pid_alive(pid), what=f"follower {pid} gone")
        return pid

    def followed_again(self, job_id: int, gone: int) -> None:
        """After its follower `gone` died: a Slurm job gets a new poller from the next request's reconcile (a
        local one has no follower again: that reconcile fails it)."""
        if self.backend == "local":
            return
        wait_for(lambda: self.job(job_id) and lock_state(poller_lock_path(self.settings)).holder_pid not in (
            None, gone), what="a new poller")
        first = beat_path(self.settings).read_text().split()[-1]  # written once it holds the lock
        wait_for(lambda: float(beat_path(self.settings).read_text().split()[-1]) > float(first) + 0.5,
                 what="the new poller's cycles")

    def close(self) -> None:
        stop_sender(self.settings)
        if self.cluster is not None:  # what is still on the cluster goes, so the next test finds its GPUs free
            sids = [str(j["slurm_job_id"]) for j in map(self.job, self.submitted)
                    if j["slurm_job_id"] and j["status"] not in TERMINAL]
            for argv in (("scancel", "--full", "--signal=KILL", *sids), ("scancel", *sids)):
                if sids:
                    self.cluster.run(*argv, check=False)
        if self.backend != "local":
            holder = lock_state(poller_lock_path(self.settings)).holder_pid
            if holder and pid_alive(holder):
                os.kill(holder, signal.SIGTERM)
                wait_for(lambda: not pid_alive(holder), what="the poller to stop")
        self.db.dispose()
        self.app.extensions["lora_worker"].db.dispose()


def start_worker(backend: str, host: Host, tmp_path: Path, hook_url: str, secret_file: Path, *, queue: bool = False,
                 stall_limits_s: dict[str, float] | None = None, cluster: Any = None) -> Worker:
    """A worker of `backend`. `queue`: jobs stay queued (locally nothing starts their supervisor; the fake Slurm
    keeps them PENDING); `stall_limits_s`: these phases' limits, the others' defaults."""
    from lora_worker import create_app

    overrides: dict[str, Any] = {"webhook_url": hook_url, "webhook_secret_file": secret_file,
                                 "webhook_progress_interval_s": 0.5,
                                 "stall_limits_s": {**DEFAULT_STALL_LIMITS_S, **(stall_limits_s or {})}}
    if backend == "slurm":
        overrides.update(backend="slurm", slurm_bin_dir=install_fake_slurm(tmp_path / "slurm-bin"),
                         slurm_poll_interval_s=0.2)
        if queue:
            (overrides["slurm_bin_dir"] / "hold").touch()
    if backend == "cluster":
        from tests.cluster.worker import slurm_settings

        overrides.update(slurm_settings(cluster, tmp_path))
    settings = host.settings.with_overrides(**overrides)
    migrated_ledger(settings.database_path)
    app = create_app(settings, launch=Launches() if queue and backend == "local" else None)
    app.config["TESTING"] = True
    return Worker(backend, host, settings, app.test_client(), Database.open(settings.database_path), app, cluster)


# -- what a job's end is, as the contract compares it ------------------------------------------------------

@dataclass(frozen=True)
class End:
    """A job's end as every backend must record it: the row, its events, its webhook bodies, its files."""

    status: str
    failure_class: str | None
    phase: str | None
    lora: bool  # the row names a LoRA, with its hash
    events: tuple[tuple[str, ...], ...]  # (from, to) of each change, ("phase", p) and ("note", …) of the rest
    hooks: tuple[tuple[Any, ...], ...]  # each webhook body but job.progress: its type and what it says,
    # the job.checkpoint and job.sample ones last
    files: tuple[str, ...]  # the output directory's entries, the job's id written <id>


def end_of(worker: Worker, job_id: int) -> End:
    row = worker.job(job_id)
    # A write may carry several phases, a step LoRA's verification and a sample pass over: their order among the
    # phases is the write's, not the run's, so they are compared apart, after the rest.
    said = hooks(worker, job_id)
    apart = (outbox.CHECKPOINT, SAMPLE)
    return End(row["status"], row["failure_class"], row["phase"], bool(row["lora_path"] and row["lora_sha256"]),
               tuple(_event(e.from_status, e.to_status, e.reason) for e in repo.job_events(worker.db, job_id)),
               tuple(h for h in said if h[0] not in (outbox.PROGRESS, *apart))
               + tuple(sorted(h for h in said if h[0] in apart)), files(worker, job_id))


def _event(frm: str | None, to: str, reason: str | None) -> tuple[str, ...]:
    if frm != to:
        return (frm or "", to)
    if reason and reason.startswith("phase "):
        return ("phase", reason.removeprefix("phase "))
    if reason and reason.startswith("no finished LoRA"):
        return ("note", "LoRA moved aside")
    return ("note", reason or "")


def hooks(worker: Worker, job_id: int) -> list[tuple[Any, ...]]:
    """Each webhook body of the job, oldest first: its type and the fields a receiver acts on."""
    with worker.db.reading() as d:
        bodies = [json.loads(body) for _, body in outbox.bodies(d, job_id)]
    found: list[tuple[Any, ...]] = []
    for body in bodies:
        data = body["data"]
        if body["type"] == outbox.PHASE:
            found.append((body["type"], data["phase"]))
        elif body["type"] == outbox.CHECKPOINT:
            point = data["checkpoint"]
            found.append((body["type"], point["step"], point["verified"], point["error"] is not None))
        elif body["type"] == SAMPLE:  # the pass's step, its images (of the prompts), its step LoRA's step and verdict
            sample, lora = data["sample"], data["sample"]["lora"]
            found.append((body["type"], sample["step"], len(sample["images"]), sample["expected"],
                          lora and (lora["step"], lora["verified"])))
        elif body["type"] in outbox.TERMINAL_EVENTS.values():
            found.append((body["type"], data["status"], data["failure_class"], data["lora_path"] is not None,
                          data["lora_sha256"] is not None))
        else:
            found.append((body["type"], data["status"]))
    return found


def files(worker: Worker, job_id: int) -> tuple[str, ...]:
    row = repo.get_job(worker.db, job_id)
    output = Path(row.output_dir)
    names = sorted(p.name for p in output.iterdir()) if output.is_dir() else []
    return tuple(n.replace(f"-{job_id}", "-<id>") for n in names)


def phases(*names: str) -> tuple[tuple[str, ...], ...]:
    return tuple(("phase", n) for n in names)


def phase_hooks(*names: str) -> tuple[tuple[str, ...], ...]:
    return tuple((outbox.PHASE, n) for n in names)

"""A scheduler that answers like Slurm's commands from a table the test sets, and records what it is asked."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable

from lora_worker.config import Settings
from lora_worker.slurm.scheduler import Node, Scheduler, SchedulerUnavailable, SlurmJob
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job
from lora_worker.slurm.backend import SlurmBackend
from lora_worker.slurm.poller import Poller
from lora_worker.slurm.sbatch import log_path, rc_path
from tests.helpers import Host, payload
from tests.helpers.ledger import migrated_ledger


@dataclass
class FakeScheduler(Scheduler):
    """`jobs` is what squeue shows, `accounted` what sacct shows; `down` makes every command fail."""

    jobs: dict[str, SlurmJob] = field(default_factory=dict)
    accounted: dict[str, SlurmJob] = field(default_factory=dict)
    calls: list[tuple[str, ...]] = field(default_factory=list)
    scripts: dict[str, Path] = field(default_factory=dict)
    options: dict[str, list[str]] = field(default_factory=dict)
    down: bool = False
    sacct_down: bool = False  # slurmdbd does not answer; slurmctld (squeue, scontrol) does
    next_id: int = 1000

    def __post_init__(self) -> None:
        super().__init__(None)

    def _check(self, *call: str) -> None:
        self.calls.append(call)
        if self.down:
            raise SchedulerUnavailable(f"{call[0]}: slurm_load_jobs error: Unable to contact slurm controller")

    args: dict[str, list[str]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # job id -> --job-name
    # "queue-then-fail" / "queue-then-timeout": sbatch queues the job and then raises, as a slurmctld that
    # took the job and answered too late (or an sbatch that failed after the RPC) does.
    sbatch_trouble: str | None = None

    def submit(self, options: list[str], script: Path, args: Iterable[str] = ()) -> str:
        self._check("sbatch", *options, str(script), *args)
        self.next_id += 1
        sid = str(self.next_id)
        self.scripts[sid], self.options[sid], self.args[sid] = script, options, list(args)
        self.names[sid] = next(o.split("=", 1)[1] for o in options if o.startswith("--job-name="))
        self.jobs[sid] = SlurmJob(sid, "PENDING", "Priority", detail="PENDING")
        if self.sbatch_trouble == "queue-then-fail":
            raise SchedulerUnavailable("sbatch exited 1: sbatch: error: Batch job submission failed: "
                                       "Socket timed out on send/recv operation")
        if self.sbatch_trouble == "queue-then-timeout":
            raise SchedulerUnavailable("sbatch: Command '['sbatch', …]' timed out after 30.0 seconds")
        return sid

    def find_by_name(self, name: str) -> list[str]:
        self._check("squeue", f"--name={name}")
        return sorted(sid for sid, n in self.names.items() if n == name and sid in self.jobs)

    def cancel_by_name(self, name: str) -> None:
        self._check("scancel", f"--name={name}")
        for sid, n in self.names.items():
            if n == name and sid in self.jobs and self.jobs[sid].state in ("PENDING", "RUNNING"):
                self.set(sid, "CANCELLED", detail="CANCELLED by 0")

    def running(self) -> list[str]:
        """The jobs Slurm would still run (pending or running)."""
        return sorted(sid for sid, j in self.jobs.items() if j.state in ("PENDING", "RUNNING"))

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        self._check("scancel", *((f"--signal={signal}", "--full") if signal else ()), job_id)

    def queue(self, job_ids: Iterable[str]) -> dict[str, SlurmJob]:
        ids = sorted(set(job_ids))
        self._check("squeue", *ids)
        return {i: self.jobs[i] for i in ids if i in self.jobs}

    def accounting(self, job_ids: Iterable[str]) -> dict[str, SlurmJob]:
        ids = sorted(set(job_ids))
        self._check("sacct", *ids)
        if self.sacct_down:
            raise SchedulerUnavailable("sacct: Problem talking to the database: Connection refused")
        return {i: self.accounted[i] for i in ids if i in self.accounted}

    def show(self, job_id: str) -> SlurmJob | None:
        self._check("scontrol", job_id)
        return self.jobs.get(job_id)

    def set(self, sid: str, state: str, reason: str | None = None, code: int | None = None,
            signal: int | None = None, *, detail: str | None = None, accounted: bool = True) -> None:
        job = SlurmJob(sid, state, reason, code, signal, detail=detail or state)
        self.jobs[sid] = job
        if accounted:
            self.accounted[sid] = job

    def cancels(self) -> list[tuple[str, ...]]:
        return [c for c in self.calls if c[0] == "scancel"]

    # The cluster the deep health check asks after (`scontrol ping`, `sinfo --Node`): slurmctld's word, and the
    # partition's nodes as sinfo prints them.
    controller: str = "UP"
    cluster: list[Node] = field(default_factory=lambda: [Node("node1", "idle", "gpu:fake:2", "(null)")])

    def ping(self) -> list[tuple[str, str]]:
        self._check("scontrol", "ping")
        return [("Slurmctld(primary) at ctl", self.controller)]

    def nodes(self, partition: str) -> list[Node]:
        self._check("sinfo", "--Node", f"--partition={partition}")
        return list(self.cluster)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_batch_script(script: Path, args: list[str], log: Path, timeout: float = 60.0) -> int:
    """What a node does with the script: run it with its arguments, its stdout and stderr into sbatch's
    --output file (appended to, as --open-mode=append does)."""
    with log.open("ab") as out:
        return subprocess.run([str(script), *args], stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False).returncode


def with_argv(settings: Settings, job_id: int, argv: list[str]) -> None:
    """The job's spec with another stored argv, as if dispatch had built that one (a test's trainer)."""
    from lora_worker.slurm.sbatch import spec_path

    path = spec_path(settings, job_id)
    spec = json.loads(path.read_text())
    spec["job"]["argv"] = argv
    path.write_text(json.dumps(spec))


@dataclass
class SlurmWorker:
    host: Host
    settings: Settings
    db: Database
    scheduler: FakeScheduler
    clock: Clock
    client: object
    poller: Poller

    def submit(self, n: int = 0, **overrides: object) -> Job:
        body = payload(self.host.dataset, self.host.model, output_dir=str(self.host.dataset.parent / f"output{n}"),
                       **overrides)
        answer = self.client.post("/train", json=body)
        assert answer.status_code == 202, answer.get_json()
        return repo.get_job(self.db, answer.get_json()["worker_job_id"])

    def job(self, job_id: int) -> Job:
        return repo.get_job(self.db, job_id)

    def log(self, job: Job, text: str | bytes) -> None:
        data = text.encode() if isinstance(text, str) else text
        with log_path(self.settings, job.id).open("ab") as fh:
            fh.write(data)

    def rc(self, job: Job, returncode: int) -> None:
        rc_path(self.settings, job.id).write_text(f"{returncode}\n")

    def cycles(self, n: int = 1) -> None:
        for _ in range(n):
            self.poller.cycle()

    def new_poller(self) -> Poller:
        self.poller.close()
        self.poller = Poller(self.settings, self.db, self.scheduler, self.clock)
        return self.poller


def slurm_worker(host: Host, **overrides: object) -> tuple[SlurmWorker, object]:
    from lora_worker import create_app

    settings = host.settings.with_overrides(backend="slurm", max_active_jobs=3, **overrides)
    migrated_ledger(settings.database_path)
    scheduler, clock = FakeScheduler(), Clock()
    db = Database.open(settings.database_path)
    backend = SlurmBackend(scheduler=scheduler, start_poller=lambda s: None, db=db)
    app = create_app(settings, backend=backend)
    app.config["TESTING"] = True
    return SlurmWorker(host, settings, db, scheduler, clock, app.test_client(),
                       Poller(settings, db, scheduler, clock)), app


def close_worker(worker: SlurmWorker, app: object) -> None:
    worker.poller.close()
    app.extensions["lora_worker"].db.dispose()  # type: ignore[attr-defined]
    worker.db.dispose()


def steps_bar(step: int, total: int = 400, loss: float = 0.1) -> str:
    return f"\rsteps: {100 * step // total:3d}%|#####     | {step}/{total} [00:10<00:12,  2.00it/s, avr_loss={loss}]"


def cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


FAKE_TOOLS = Path(__file__).parent / "fake_slurm" / "slurm.py"


def install_fake_slurm(bin_dir: Path) -> Path:
    bin_dir.mkdir(parents=True)
    tool = bin_dir / "slurm.py"
    tool.write_text(f"#!{sys.executable}\n" + FAKE_TOOLS.read_text())
    tool.chmod(0o755)
    for name in ("sbatch", "squeue", "sacct", "scancel", "scontrol", "sinfo", "srun"):
        (bin_dir / name).symlink_to(tool)
    return bin_dir

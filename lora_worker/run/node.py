"""`python -m lora_worker.run.node <spec.json>`: start one job's trainer on this host, once, as a batch job does
on a cluster node (slurm/sbatch.py writes the spec and the three-line script that runs this).

It keeps the local supervisor's promises about the start, with the same code: the pre-exec identity look of
run/prelaunch.py right before the exec (a directory swapped, a new subset folder, an image turned into a
link, anything at the LoRA's path: the trainer does not start), and the trainer inside the same bubblewrap
sandbox (host/sandbox.py), refused the same way when bwrap is missing here. A refusal is written to the
spec's `refusal_file` (the poller ends the row `launch_error` with it) and the trainer never runs.

Everything comes from the spec, as data: argv, env and paths are JSON, never source text, so any character a
train id may hold reaches the trainer as it does locally. The spec is read without following a link or
blocking; the files written next to it (the refusal, the trainer's return code) are made O_EXCL|O_NOFOLLOW,
and the job's log must be the file the worker made (stdout is checked against its recorded identity) or the
trainer does not start.

SIGTERM is ignored by a handler that does nothing (the trainer, exec'd afresh, gets the default back) so that a
TERM to the whole job stops the trainer, and this process lives to record how it ended: the exact Popen
return code, which a batch job's own exit status (truncated above 127, 128 + n for a signal) cannot carry.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_worker.config import Settings, settings_from_json
from lora_worker.host import fs, sandbox
from lora_worker.ledger.supervisor import JobRecord
from lora_worker.run.prelaunch import check

SPEC_MAX_BYTES = 4 << 20
USAGE = "usage: python -m lora_worker.run.node <spec.json> | --probe <sandbox> | --probe-trainer <settings.json>"


@dataclass(frozen=True)
class Spec:
    job: JobRecord
    settings: Settings
    cwd: str
    from_environment: tuple[str, ...]
    log_file: str
    log_id: str
    rc_file: str
    refusal_file: str


def read_spec(path: str) -> Spec:
    fd, _ = fs.open_regular(None, path)
    try:
        doc: dict[str, Any] = json.loads(fs.read_capped(fd, SPEC_MAX_BYTES).decode("utf-8"))
    finally:
        os.close(fd)
    return Spec(job=JobRecord(**doc["job"]), settings=settings_from_json(json.dumps(doc["settings"])),
                cwd=doc["cwd"], from_environment=tuple(doc["from_environment"]), log_file=doc["log_file"],
                log_id=doc["log_id"], rc_file=doc["rc_file"], refusal_file=doc["refusal_file"])


def note(text: str) -> None:
    print(f"[lora-worker] {text}", flush=True)


def why_not(spec: Spec) -> str | None:
    """Why the trainer must not start here (a sentence), or None; the directories are looked at last
    (`check`, whose descriptors the sandbox then binds)."""
    for stream in (sys.stdout, sys.stderr):
        now = fs.FileId.of(os.fstat(stream.fileno()))
        if str(now) != spec.log_id:
            return (f"the job's output is not the log file the worker made ({spec.log_file}: was {spec.log_id}, "
                    f"now {now})")
    if problem := sandbox.unavailable(spec.settings):
        return f"on node {os.uname().nodename}, {problem}"
    return None


def refuse(spec: Spec, sentence: str) -> int:
    note(f"refusing to start the trainer: {sentence}")
    try:
        fs.create_new(spec.refusal_file, sentence.encode() + b"\n")
    except OSError as exc:
        note(f"cannot record the refusal in {spec.refusal_file}: {exc}")
    return 1


def record_rc(path: str, rc: int) -> None:
    """The return code, whole or not at all: a new file beside it, then linked to its name (which must be free)."""
    tmp = f"{path}.tmp"
    fs.create_new(tmp, f"{rc}\n".encode())
    try:
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


def start(spec: Spec) -> int:
    job, settings = spec.job, spec.settings
    # What the batch system says (the GPU it allocated) replaces the stored values, which name the request's
    # device on the worker's host; when it says nothing, the stored value is dropped, never used here.
    env = {k: v for k, v in job.env.items() if k not in spec.from_environment}
    env.update({name: os.environ[name] for name in spec.from_environment if name in os.environ})
    given = ", ".join(f"{name}={env.get(name, '')}" for name in spec.from_environment)
    note(f"job {job.id}: on {os.uname().nodename}, {given}")
    note(f"sandbox: {sandbox.describe(settings)}")
    if (sentence := why_not(spec)) is not None:
        return refuse(spec, sentence)
    checked = check(job)  # the last look, right before exec; the sandbox binds the very directories it saw
    try:
        if checked.moved is not None:
            return refuse(spec, checked.moved)
        paths = sandbox.JobPaths(Path(job.dataset_dir), Path(job.base_model_path), Path(job.output_dir),
                                 read_only=sandbox.argv_files(job.argv))
        command = sandbox.wrap(job.argv, paths, settings, sandbox.host_facts(settings), checked.held)
        try:
            trainer = subprocess.Popen(command, cwd=spec.cwd, env=env, stdin=subprocess.DEVNULL,  # noqa: S603
                                       pass_fds=tuple(checked.held.values()))
        except OSError as exc:
            return refuse(spec, f"cannot start the trainer: {exc}")
    finally:
        checked.close()  # bwrap has its own copies by now
    rc = sandbox.wait_status(trainer.wait(), settings)
    assert rc is not None  # noqa: S101 - wait() returned: the trainer has a return code
    try:
        record_rc(spec.rc_file, rc)
    except OSError as exc:
        note(f"cannot record the return code in {spec.rc_file}: {exc}")
    note(f"trainer ended with return code {rc}")
    return 0 if rc == 0 else 1


def probe(kind: str) -> int:
    """For `doctor`, run on a node: whether this node could start a trainer in the `kind` sandbox (bwrap
    installed and able to make its namespaces). Prints `ok` or the problem."""
    try:
        problem = sandbox.probe(Settings(sandbox=kind))
    except Exception as exc:  # noqa: BLE001 - a sentence for the operator, whatever went wrong here
        problem = f"{type(exc).__name__}: {exc}"
    print(problem or "ok", flush=True)
    return 1 if problem else 0


def probe_trainer(path: str) -> int:
    """For the deep health check's probe job (slurm/health.py), run on a node: the trainer probe of the local deep
    check (host/trainer_probe.py), in the job's sandbox and environment with the worker's settings (the JSON file
    at `path`) and the GPU Slurm allocated. Prints its marked answer line, with this node's name and, where the
    probe could not run, `problem`."""
    from lora_worker.host.trainer import trainer_env
    from lora_worker.host.trainer_probe import MARK, run_probe

    answer: dict[str, Any] = {}
    try:
        fd, _ = fs.open_regular(None, path)
        try:
            settings = settings_from_json(fs.read_capped(fd, SPEC_MAX_BYTES).decode("utf-8"))
        finally:
            os.close(fd)
        answer, problem = run_probe(settings, trainer_env(settings, os.environ.get("CUDA_VISIBLE_DEVICES")))
    except Exception as exc:  # noqa: BLE001 - a sentence for the operator, whatever went wrong here
        problem = f"{type(exc).__name__}: {exc}"
    said = {**answer, "node": os.uname().nodename, **({"problem": problem} if problem else {})}
    print(MARK + json.dumps(said), flush=True)
    return 1 if problem else 0


def main(argv: list[str]) -> int:
    # Outlive the trainer: a TERM to the whole job reaches us too, and we must record how it ended.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    if len(argv) == 2 and argv[0] == "--probe":
        return probe(argv[1])
    if len(argv) == 2 and argv[0] == "--probe-trainer":
        return probe_trainer(argv[1])
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        spec = read_spec(argv[0])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        note(f"cannot read the job's spec {argv[0]}: {exc}")  # no refusal file: where it goes is in the spec
        return 1
    return start(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

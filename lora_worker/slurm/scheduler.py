"""Thin wrappers over Slurm's commands, and the parsing of what they print. Nothing here decides anything.

Formats (Slurm 22.05, the version the reference ran; each is what a test feeds back):
- `sbatch --parsable` prints `<jobid>` or `<jobid>;<cluster>`;
- `squeue --noheader --states=all --jobs=<ids> --format=%i|%T|%r` prints `123|PENDING|Resources`; an id it
  does not know makes it fail with `Invalid job id specified` (a single id) or leaves the id out (several);
- `sacct --noheader --parsable2 --allocations --jobs=<ids> --format=JobID,State,ExitCode,Reason` prints
  `123|CANCELLED by 0|0:15|None`: the state's first word is the state, ExitCode is `<code>:<signal>` (codes
  above 127 are truncated, which is why the batch script records the trainer's status itself);
- `scontrol show job --oneliner <id>` prints `JobId=123 JobName=lora-1 … JobState=FAILED Reason=… ExitCode=200:0`;
- `scontrol ping` prints `Slurmctld(primary) at <host> is UP` (or `DOWN`), a line per controller;
- `sinfo --noheader --Node --partition=<p> --format=%N|%T|%G|%f` prints `node1|idle|gpu:fake:2|(null)`: each node
  of the partition, its state in the long form (`mixed`, `drained`, `down*`: `*` is "not responding"), its GRES
  and its available features.

A command that cannot run, times out or fails for another reason raises SchedulerUnavailable: the caller
then knows nothing this cycle, which is not the same as "Slurm does not know the job".
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

COMMAND_TIMEOUT_S = 30.0
Run = Callable[[list[str]], "Result"]


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


class SchedulerUnavailable(Exception):
    """A Slurm command did not answer (not installed, slurmctld down, timed out, refused)."""


@dataclass(frozen=True)
class SlurmJob:
    """One job as a Slurm command reported it."""

    job_id: str
    state: str  # the state word: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, OUT_OF_MEMORY, TIMEOUT, …
    reason: str | None = None  # why it pends (Resources, Priority, BeginTime); None for "None"
    exit_code: int | None = None  # ExitCode's first half (sacct truncates it above 127)
    exit_signal: int | None = None  # ExitCode's second half
    detail: str = ""  # the state as printed ("CANCELLED by 0"), for a sentence


# What a Slurm client takes from its environment to filter or reshape its answer (SQUEUE_USERS, SACCT_FORMAT,
# SLURM_TIME_FORMAT…): the worker's commands must answer for the ids asked, in the format parsed here.
FILTERS = ("SQUEUE_", "SACCT_", "SLURM_", "SCANCEL_", "SCONTROL_", "SBATCH_", "SINFO_", "SRUN_")
KEPT = ("SLURM_CONF",)  # which cluster: the one thing the caller's environment says


def command_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    return {k: v for k, v in env.items() if k in KEPT or not k.startswith(FILTERS)}


@dataclass(frozen=True)
class Node:
    """One node of a partition as `sinfo --Node` reported it."""

    name: str
    state: str  # the long form: idle, mixed, allocated, completing, drained, draining, down*, …
    gres: str  # `gpu:a100:4(S:0-1)`, or `(null)`
    features: str  # the available features, comma-separated, or `(null)`


def run_command(argv: list[str]) -> Result:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False,  # noqa: S603
                              stdin=subprocess.DEVNULL, errors="replace", env=command_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchedulerUnavailable(f"{argv[0]}: {exc}") from exc
    return Result(done.returncode, done.stdout, done.stderr)


class Scheduler:
    """Slurm's commands from `bin_dir` (or PATH), run through `run` (a test passes recorded outputs)."""

    def __init__(self, bin_dir: Path | None = None, run: Run = run_command) -> None:
        self.bin_dir = bin_dir
        self.run = run

    def command(self, name: str) -> str:
        return str(self.bin_dir / name) if self.bin_dir else name

    def _call(self, name: str, *args: str) -> Result:
        return self.run([self.command(name), *args])

    def _ok(self, name: str, *args: str) -> str:
        result = self._call(name, *args)
        if result.returncode != 0:
            raise SchedulerUnavailable(f"{name} exited {result.returncode}: {result.stderr.strip()[:500]}")
        return result.stdout

    # -- submission and signals -------------------------------------------------------------------------

    def submit(self, options: list[str], script: Path, args: Iterable[str] = ()) -> str:
        """The new job's id, once sbatch accepted the script (run with `args`); SchedulerUnavailable with sbatch's
        words if not."""
        return parse_sbatch(self._ok("sbatch", *options, str(script), *args))

    def find_by_name(self, name: str) -> list[str]:
        """The ids of the jobs named `name`: squeue's (pending, running, ended for MinJobAge), else sacct's."""
        result = self._call("squeue", "--noheader", "--states=all", f"--name={name}", "--format=%i|%T|%r")
        if result.returncode == 0:
            return sorted({j.job_id for j in parse_squeue(result.stdout)})
        out = self._ok("sacct", "--noheader", "--parsable2", "--allocations", f"--name={name}",
                       "--starttime=now-7days", "--format=JobID,State,ExitCode,Reason")
        return sorted({j.job_id for j in parse_sacct(out)})

    def cancel_by_name(self, name: str) -> None:
        """`scancel --name=<name>`: every job of that name, whether or not its id was ever known."""
        self._ok("scancel", f"--name={name}")

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        """`scancel <id>`, or with a signal `scancel --signal=<sig> --full <id>`: the batch shell and every
        process of the job get it (proctrack/cgroup finds those that left the process group)."""
        args = [f"--signal={signal}", "--full", job_id] if signal else [job_id]
        result = self._call("scancel", *args)
        if result.returncode != 0 and "Invalid job id" not in result.stderr:  # a job gone is a job stopped
            raise SchedulerUnavailable(f"scancel exited {result.returncode}: {result.stderr.strip()[:500]}")

    # -- asking after jobs ------------------------------------------------------------------------------

    def queue(self, job_ids: Iterable[str]) -> dict[str, SlurmJob]:
        """What slurmctld knows of these jobs now (pending, running, and ended ones for MinJobAge).

        Only a real answer says a job is not listed: "Invalid job id" for one id, or a listing that names some
        of the ids. A listing that names none of several ids is asked again id by id; an empty listing for one
        id (exit 0, no line: a filter, a client that answered nothing) or a line that does not parse is no
        answer at all (SchedulerUnavailable), never "gone"."""
        ids = sorted(set(job_ids))
        if not ids:
            return {}
        result = self._call("squeue", "--noheader", "--states=all", f"--jobs={','.join(ids)}", "--format=%i|%T|%r")
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return {}  # none of them is known any more
            raise SchedulerUnavailable(f"squeue exited {result.returncode}: {result.stderr.strip()[:500]}")
        listed = {j.job_id: j for j in parse_squeue(result.stdout, strict=True) if j.job_id in ids}
        if listed:
            return listed
        if len(ids) == 1:
            raise SchedulerUnavailable(f"squeue answered nothing for job {ids[0]} (exit 0, no line)")
        found: dict[str, SlurmJob] = {}
        for job_id in ids:
            found.update(self.queue([job_id]))
        return found

    def accounting(self, job_ids: Iterable[str]) -> dict[str, SlurmJob]:
        """What slurmdbd recorded of these jobs (it outlives slurmctld's memory of them)."""
        ids = sorted(set(job_ids))
        if not ids:
            return {}
        out = self._ok("sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={','.join(ids)}",
                       "--format=JobID,State,ExitCode,Reason")
        return {j.job_id: j for j in parse_sacct(out) if j.job_id in ids}

    def show(self, job_id: str) -> SlurmJob | None:
        """`scontrol show job`: slurmctld's full record (its ExitCode is not truncated), None once forgotten."""
        result = self._call("scontrol", "show", "job", "--oneliner", job_id)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return None
            raise SchedulerUnavailable(f"scontrol exited {result.returncode}: {result.stderr.strip()[:500]}")
        return parse_scontrol(result.stdout)


    # -- asking after the cluster (the deep health check, health.py) ----------------------------------

    def ping(self) -> list[tuple[str, str]]:
        """`scontrol ping`: each controller and what it says of itself (`UP`, `DOWN`); SchedulerUnavailable when
        the command answered no such line."""
        result = self._call("scontrol", "ping")
        found = parse_ping(result.stdout)
        if not found:
            said = (result.stderr.strip() or result.stdout.strip()).splitlines()
            raise SchedulerUnavailable(f"scontrol ping exited {result.returncode}"
                                       + (f": {said[-1][:300]}" if said else ""))
        return found

    def nodes(self, partition: str) -> list[Node]:
        """Every node of `partition`, with its state, GRES and features (none: the partition lists no node)."""
        return parse_sinfo_nodes(self._ok("sinfo", "--noheader", "--Node", f"--partition={partition}",
                                          "--format=%N|%T|%G|%f"))


PING = re.compile(r"^(Slurmctld\([^)]*\) at \S+) is (\w+)")


def parse_ping(out: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for line in out.splitlines() if (m := PING.match(line.strip()))]


def parse_sinfo_nodes(out: str) -> list[Node]:
    nodes = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            nodes.append(Node(*(p.strip() for p in parts)))
    return nodes


def parse_sbatch(out: str) -> str:
    job_id = out.strip().split(";", 1)[0]
    if not job_id.isdigit():
        raise SchedulerUnavailable(f"sbatch printed no job id: {out.strip()[:200]!r}")
    return job_id


def parse_squeue(out: str, *, strict: bool = False) -> list[SlurmJob]:
    """`strict`: a line that is not `<id>|<STATE>|<reason>` makes the whole answer SchedulerUnavailable."""
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].strip():
            jobs.append(SlurmJob(parts[0], parts[1].strip(), _reason(parts[2]), detail=parts[1].strip()))
        elif strict and line.strip():
            raise SchedulerUnavailable(f"squeue printed a line this worker cannot read: {line.strip()[:200]!r}")
    return jobs


def parse_sacct(out: str) -> list[SlurmJob]:
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0]:
            continue
        code, signal = _exit_code(parts[2])
        state = parts[1].split(" ", 1)[0] if parts[1] else ""
        jobs.append(SlurmJob(parts[0], state, _reason(parts[3]) if len(parts) > 3 else None, code, signal,
                             detail=parts[1]))
    return jobs


def parse_scontrol(out: str) -> SlurmJob | None:
    fields = dict(token.split("=", 1) for token in out.split() if "=" in token)
    if "JobId" not in fields:
        return None
    code, signal = _exit_code(fields.get("ExitCode", ""))
    state = fields.get("JobState", "")
    return SlurmJob(fields["JobId"], state, _reason(fields.get("Reason", "")), code, signal, detail=state)


def _reason(text: str) -> str | None:
    text = text.strip()
    return None if text in ("", "None", "(null)") else text.strip("()")


def _exit_code(text: str) -> tuple[int | None, int | None]:
    code, _, signal = text.strip().partition(":")
    return (int(code) if code.isdigit() else None, int(signal) if signal.isdigit() else None)


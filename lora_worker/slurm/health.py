"""The Slurm backend's deep health checks (`GET /healthz?deep=1`, `doctor`): can a job run on the cluster now?

- `slurm controller`: `scontrol ping` says slurmctld is UP (every submission and every poll needs it);
- `slurm nodes for <tiers>`: for each set of resources the tiers ask (`slurm_resources`: gres and constraint), the
  partition has a node in a usable state (idle, mixed, allocated, completing; not down, drained, draining, failing
  or not responding) whose GRES has such a GPU and whose features meet the constraint;
- `slurm trainer probe for <tiers>` (with `trainer`: doctor --strict and the service's start-up check), opt-in by
  `slurm_probe_job` since it takes a node and its GPU for up to a few minutes: `srun` runs on a node the trainer
  probe of the local deep check (host/trainer_probe.py, through run/node.py `--probe-trainer`) in a job's sandbox
  and environment, with the GPU Slurm allocated.
What cannot be checked (the controller silent, a constraint this does not read, no node free for the probe, the
probe off) is said so (`Check.unchecked`), never passed: `doctor --strict` fails on it.
"""
from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from lora_worker.checks import Check
from lora_worker.config import Settings, settings_to_json
from lora_worker.host import fs
from lora_worker.host.trainer_probe import TIMEOUT_S, answer_of
from lora_worker.slurm.scheduler import Node, Scheduler, SchedulerUnavailable, command_env

USABLE = ("idle", "mixed", "allocated", "completing", "planned")  # a node that takes (or will take) new jobs
HARMLESS = ("cloud", "planned", "completing")  # what may follow a usable state after `+` (newer Slurm)
PROBE_WAIT_S = 30  # srun --immediate: no node free within it is "not checked", never a wait
PROBE_TIMEOUT_S = PROBE_WAIT_S + TIMEOUT_S + 30  # the allocation, the probe itself, the job's start and end


def cluster_checks(settings: Settings, scheduler: Scheduler, *, trainer: bool) -> list[Check]:
    groups = resource_groups(settings)
    controller = controller_check(scheduler)
    if not controller.ok:
        silent = "the controller does not answer"
        return [controller, *(Check.unchecked(f"slurm nodes for {', '.join(t)}", silent) for t in groups.values()),
                *([Check.unchecked("slurm trainer probe", silent)] if trainer else [])]
    checks = [controller, *node_checks(settings, scheduler, groups)]
    if trainer:
        checks += probe_checks(settings, scheduler, groups)
    return checks


def resource_groups(settings: Settings) -> dict[tuple[str, str], list[str]]:
    """(gres, constraint) → the tiers that ask for it, in the tiers' order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for tier, resources in settings.slurm_resources.items():
        groups.setdefault((resources.gres, resources.constraint), []).append(tier)
    return groups


def controller_check(scheduler: Scheduler) -> Check:
    try:
        said = scheduler.ping()
    except SchedulerUnavailable as exc:
        return Check("slurm controller", False, f"{exc}; fix: start slurmctld, and point SLURM_CONF and slurm_bin_dir "
                     "at the cluster, with munged running here")
    up = [who for who, state in said if state.upper() == "UP"]
    words = "; ".join(f"{who} is {state}" for who, state in said)
    if not up:
        return Check("slurm controller", False, f"{words}; fix: start slurmctld")
    return Check("slurm controller", True, words)


def node_checks(settings: Settings, scheduler: Scheduler, groups: Mapping[tuple[str, str], list[str]]) -> list[Check]:
    partition = settings.slurm_partition
    try:
        nodes = scheduler.nodes(partition)
    except SchedulerUnavailable as exc:
        return [Check(f"slurm nodes for {', '.join(tiers)}", False, f"sinfo does not answer: {exc}")
                for tiers in groups.values()]
    return [nodes_check(partition, nodes, gres, constraint, tiers) for (gres, constraint), tiers in groups.items()]


def nodes_check(partition: str, nodes: list[Node], gres: str, constraint: str, tiers: list[str]) -> Check:
    name = f"slurm nodes for {', '.join(tiers)}"
    wanted = f"gres {gres}" + (f" and features {constraint}" if constraint else "")
    if not nodes:
        return Check(name, False, f"partition {partition} lists no node; fix: set slurm_partition to a partition "
                     "of the cluster (`sinfo` lists them), or give it nodes in slurm.conf")
    meets = feature_test(constraint)
    if meets is None:
        return Check.unchecked(name, f"the constraint {constraint!r} is more than this check reads (feature names "
                               "joined by & or by |)")
    fits = [n for n in nodes if has_gpu(n.gres, gres) and meets(n.features)]
    usable = [n for n in fits if usable_state(n.state)]
    if usable:
        return Check(name, True, f"{len(usable)} of {len(nodes)} node(s) of {partition} usable with {wanted}: "
                     + listed(usable))
    if fits:
        return Check(name, False, f"no node of {partition} with {wanted} is in a usable state: {listed(fits)}; "
                     "jobs of these tiers would wait forever; fix: bring them back (`scontrol update "
                     "NodeName=<node> State=RESUME` once their trouble is fixed)")
    return Check(name, False, f"no node of {partition} has {wanted} (they have: {listed(nodes, gres=True)}); jobs "
                 "of these tiers would wait forever; fix: the tiers' slurm_resources, or Gres= and Feature= of the "
                 "nodes in slurm.conf and gres.conf")


def listed(nodes: list[Node], *, gres: bool = False) -> str:
    shown = [f"{n.name} ({n.state}" + (f", {n.gres}, features {n.features}" if gres else "") + ")" for n in nodes]
    return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")


def usable_state(state: str) -> bool:
    """Whether a node in this sinfo state takes new jobs: `*` (not responding) and `$` (a maintenance
    reservation) say no whatever the state; the other flags (`~` powered down, `#` powering up…) do not."""
    if "*" in state or "$" in state:
        return False
    base, *more = state.lower().rstrip("~#!%@^-").split("+")
    return base in USABLE and all(m in HARMLESS for m in more)


def gpus_offered(gres: str) -> list[tuple[str | None, int]]:
    """(type or None, count) of each `gpu` in a node's GRES (`gpu:a100:4(S:0-1),gpu:2`); nothing for `(null)`."""
    offered = []
    for item in re.split(r",(?![^()]*\))", gres):  # the commas between items, not those of a socket list
        parts = re.sub(r"\(.*\)$", "", item.strip()).split(":")
        if parts[0] != "gpu":
            continue
        count = re.match(r"\d+", parts[-1]) if len(parts) > 1 else None
        kind = parts[1] if len(parts) == 3 or (len(parts) == 2 and count is None) else None
        offered.append((kind, int(count.group()) if count else 1))
    return offered


def has_gpu(node_gres: str, wanted: str) -> bool:
    """Whether a node's GRES holds the one GPU `wanted` asks (`gpu:1`: any; `gpu:<type>:1`: that type)."""
    parts = wanted.split(":")
    kind = parts[1] if len(parts) == 3 else None
    return any(count >= 1 and (kind is None or kind == have) for have, count in gpus_offered(node_gres))


def feature_test(constraint: str) -> Callable[[str], bool] | None:
    """A test of a node's features for `constraint`: none, names joined by & (all) or by | (any); None for
    anything else (brackets, counts, negation), which Slurm reads and this does not."""
    name = r"[A-Za-z0-9_.-]+"
    if not constraint:
        return lambda _features: True
    if re.fullmatch(rf"{name}(&{name})*", constraint):
        return lambda features: set(constraint.split("&")) <= set(features.split(","))
    if re.fullmatch(rf"{name}(\|{name})+", constraint):
        return lambda features: bool(set(constraint.split("|")) & set(features.split(",")))
    return None


def probe_checks(settings: Settings, scheduler: Scheduler,
                 groups: Mapping[tuple[str, str], list[str]]) -> list[Check]:
    if not settings.slurm_probe_job:
        return [Check.unchecked("slurm trainer probe", "slurm_probe_job is off (the probe takes a node and its GPU "
                                "for up to a few minutes); set it to start the trainer on a node, in its sandbox")]
    return [probe_check(settings, scheduler, gres, constraint, tiers) for (gres, constraint), tiers in groups.items()]


def probe_check(settings: Settings, scheduler: Scheduler, gres: str, constraint: str, tiers: list[str]) -> Check:
    """The trainer probe, run by srun on a node with the tiers' GPU and the most host memory one of them asks; the
    worker's settings travel as a file in the shared log dir (made O_EXCL|O_NOFOLLOW, removed after)."""
    name = f"slurm trainer probe for {', '.join(tiers)}"
    mem_mb = max(settings.slurm_mem_mb[tier] for tier in tiers)
    spec = settings.slurm_logs / f"probe-{os.getpid()}-{secrets.token_hex(4)}.json"
    try:
        settings.slurm_logs.mkdir(parents=True, exist_ok=True)
        fs.create_new(str(spec), settings_to_json(settings).encode())
    except OSError as exc:
        return Check.unchecked(name, f"the probe's settings cannot be written to {settings.slurm_logs}: {exc}")
    try:
        return probe_verdict(name, gres, _srun(settings, scheduler, gres, constraint, mem_mb, str(spec)))
    finally:
        spec.unlink(missing_ok=True)


def _srun(settings: Settings, scheduler: Scheduler, gres: str, constraint: str, mem_mb: int,
          spec: str) -> subprocess.CompletedProcess[str] | str:
    argv = [scheduler.command("srun"), f"--partition={settings.slurm_partition}", "--nodes=1", "--ntasks=1",
            f"--gres={gres}", *([f"--constraint={constraint}"] if constraint else []),
            f"--mem={mem_mb}", f"--time={int(PROBE_TIMEOUT_S // 60) + 1}",
            f"--immediate={PROBE_WAIT_S}", "--job-name=lora-worker-probe", "--quiet",
            sys.executable, "-m", "lora_worker.run.node", "--probe-trainer", spec]
    try:
        return subprocess.run(argv, capture_output=True, text=True, errors="replace", env=command_env(),  # noqa: S603
                              timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"srun cannot run here ({exc})"


def probe_verdict(name: str, gres: str, done: subprocess.CompletedProcess[str] | str) -> Check:
    if isinstance(done, str):
        return Check.unchecked(name, done)
    answer = answer_of(done.stdout)
    if answer is None:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        last = said[-1][:300] if said else f"srun exited {done.returncode} without a word"
        if "allocat" in last.lower():  # srun --immediate: no node with the GPU free in time
            return Check.unchecked(name, f"no node with a free {gres} within {PROBE_WAIT_S} s ({last}); run it again "
                                   "when one is free")
        return Check(name, False, f"{last}; fix: install this worker at {sys.executable} on the nodes (shared "
                     "storage), and the trainer at the same paths")
    return Check(name, *node_answer(answer), simulated=bool(answer.get("simulated")))


def node_answer(answer: dict[str, Any]) -> tuple[bool, str]:
    """(ok, detail) of the probe's answer from a node, which sees the one GPU Slurm allocated it."""
    where = f"on node {answer.get('node', '?')}"
    if "problem" in answer:
        return False, f"{where}: {answer['problem']}; every job would fail there"
    if answer.get("simulated"):
        return True, (f"{where}: Python {answer.get('python')} starts in the job's sandbox and environment; torch, "
                      "CUDA and bitsandbytes simulated (the test double imports none, uses no GPU)")
    if "torch_error" in answer:
        return False, f"{where}: the trainer's interpreter cannot import torch: {answer['torch_error']}"
    head = f"{where}: torch {answer.get('torch')}"
    if not answer.get("cuda") or answer.get("devices") != 1:
        return False, (f"{head} sees {answer.get('devices') or 'no'} CUDA device(s), not the one GPU Slurm allocated "
                       "(GresTypes=gpu and the node's gres.conf; ConstrainDevices=yes in cgroup.conf)")
    if "bitsandbytes_error" in answer:
        return False, f"{head} ok, but bitsandbytes does not load: {answer['bitsandbytes_error']}"
    return True, (f"{head}, CUDA with the GPU Slurm allocated, bitsandbytes {answer.get('bitsandbytes')}, Python "
                  f"{answer.get('python')}")

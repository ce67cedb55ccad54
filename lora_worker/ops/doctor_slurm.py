"""`lora-worker doctor` on a Slurm backend: what the worker relies on of the cluster, asked with the commands
the worker itself runs (`sinfo` answers, the partition exists and is up, its nodes have GRES gpu,
`proctrack/cgroup` is on, `sacct` answers), and whether the shared log directory takes a file from here."""
from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys

from lora_worker.config import Settings
from lora_worker.checks import Check

SLURM_TIMEOUT_S = 15.0  # a client retries an unreachable slurmctld for ~10 s before it gives up by itself


def slurm_checks(settings: Settings) -> list[Check]:
    """What the Slurm backend needs of the cluster, asked with the commands the worker itself runs (from
    slurm_bin_dir, with this process's SLURM_CONF). Without an answer from sinfo the cluster's other checks
    would only repeat it, so they are left out."""
    answer = _slurm(settings, "sinfo", "--noheader", "--format=%P|%a|%G|%D")
    if isinstance(answer, str):
        return [Check("slurm sinfo", False, f"{answer}; fix: start slurmctld, or point SLURM_CONF (now "
                      f"{os.environ.get('SLURM_CONF') or 'unset: /etc/slurm/slurm.conf'}) and slurm_bin_dir (now "
                      f"{settings.slurm_bin_dir or 'unset: PATH'}) at the cluster, with munged running here"),
                _log_dir_check(settings)]
    partitions = _partitions(answer.stdout)
    return [Check("slurm sinfo", True, f"answers: {len(partitions)} partition(s)"),
            *_partition_checks(settings.slurm_partition, partitions), _proctrack_check(settings),
            _sacct_check(settings), _log_dir_check(settings), node_sandbox_check(settings)]


NODE_PROBE_WAIT_S = 10  # srun --immediate: a busy partition is said so, never waited on
NODE_PROBE_TIMEOUT_S = 45.0


def node_sandbox_check(settings: Settings) -> Check:
    """Whether a node of the partition can start the trainer as the batch job will: this worker's interpreter
    and package there (the batch script runs them), and bwrap able to make its namespaces, probed by the same
    code the local check runs (run/node.py --probe). A node without bwrap refuses every job (launch_error);
    this says so before one is sent. One node, whichever Slurm gives: nodes installed alike are assumed."""
    name = f"slurm node sandbox in {settings.slurm_partition}"
    command = str(settings.slurm_bin_dir / "srun") if settings.slurm_bin_dir else "srun"
    argv = [command, f"--partition={settings.slurm_partition}", "--nodes=1", "--ntasks=1", "--mem=64",
            "--time=1", f"--immediate={NODE_PROBE_WAIT_S}", "--job-name=lora-worker-doctor", "--quiet",
            sys.executable, "-m", "lora_worker.run.node", "--probe", settings.sandbox]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace",  # noqa: S603 - fixed argv
                              timeout=NODE_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check.unchecked(name, f"srun cannot run here ({exc})")
    said = (done.stdout.strip() or done.stderr.strip()).splitlines()
    last = said[-1][:300] if said else f"srun exited {done.returncode}"
    if done.returncode == 0 and last == "ok":
        return Check(name, True, f"sandbox {settings.sandbox} works on a node, with {sys.executable}")
    if "bwrap" in last or "namespaces" in last or "sandbox" in last:
        return Check(name, False, f"{last}; every job would end launch_error there; fix: install bubblewrap on "
                     "every node (apt-get install bubblewrap) and allow unprivileged user namespaces")
    if "allocat" in last.lower():  # no node free within --immediate: not checked, not failed
        return Check.unchecked(name, f"{last}; run doctor again when a node of the partition is free")
    return Check(name, False, f"{last}; fix: install this worker at {sys.executable} on the nodes (shared storage)")


def _slurm(settings: Settings, name: str, *args: str) -> subprocess.CompletedProcess[str] | str:
    """The command's result, or a sentence saying why there is none."""
    command = str(settings.slurm_bin_dir / name) if settings.slurm_bin_dir else name
    try:
        done = subprocess.run([command, *args], capture_output=True, text=True, errors="replace",  # noqa: S603
                              timeout=SLURM_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        return f"{command} is not installed (or not on PATH)"
    except OSError as exc:
        return f"{command} cannot run: {exc.strerror}"
    except subprocess.TimeoutExpired:
        return f"{name} did not answer in {SLURM_TIMEOUT_S:g}s"
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return f"{name} exited {done.returncode}" + (f": {said[-1][:300]}" if said else "")
    return done


def _partitions(sinfo: str) -> dict[str, tuple[str, list[str]]]:
    """`sinfo --format=%P|%a|%G|%D` → partition → (availability, the GRES of each node group). sinfo marks the
    default partition with a trailing `*`, and prints one line per group of nodes alike."""
    found: dict[str, tuple[str, list[str]]] = {}
    for line in sinfo.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3:
            continue
        name, avail, gres = parts[0].rstrip("*"), parts[1], parts[2]
        found.setdefault(name, (avail, []))[1].append(gres)
    return found


def _partition_checks(wanted: str, partitions: dict[str, tuple[str, list[str]]]) -> list[Check]:
    name = f"slurm partition {wanted}"
    if wanted not in partitions:
        have = ", ".join(sorted(partitions)) or "none"
        return [Check(name, False, f"not in the cluster (it has: {have}); fix: set slurm_partition to one of "
                      f"them, or add PartitionName={wanted} to slurm.conf")]
    avail, gres = partitions[wanted]
    state = Check(name, avail == "up", "up" if avail == "up" else
                  f"{avail}: jobs would wait forever; fix: scontrol update PartitionName={wanted} State=UP")
    with_gpu = [g for g in gres if any(item.split(":")[0] == "gpu" for item in g.split(","))]
    gpus = Check(f"slurm gres gpu in {wanted}", bool(with_gpu),
                 f"{', '.join(with_gpu)}" if with_gpu else
                 f"its nodes have no GRES gpu (sinfo says {', '.join(gres)}), so --gres=gpu:1 cannot be met; "
                 "fix: GresTypes=gpu and Gres=gpu:<n> on its nodes in slurm.conf, their devices in gres.conf")
    return [state, gpus]


def _proctrack_check(settings: Settings) -> Check:
    name = "slurm proctrack"
    answer = _slurm(settings, "scontrol", "show", "config")
    if isinstance(answer, str):
        return Check(name, False, f"{answer}; fix: as for sinfo")
    values = dict(line.split("=", 1) for line in answer.stdout.splitlines() if "=" in line)
    proctrack = next((v.strip() for k, v in values.items() if k.strip() == "ProctrackType"), "not reported")
    if proctrack == "proctrack/cgroup":
        return Check(name, True, "proctrack/cgroup: a cancel reaches every process of the trainer")
    return Check(name, False, f"{proctrack}: scancel misses the trainer's processes that leave its process group "
                 "(a cancelled job could leave one on the GPU); fix: ProctrackType=proctrack/cgroup in slurm.conf, "
                 "then restart slurmctld and every slurmd")


def _sacct_check(settings: Settings) -> Check:
    answer = _slurm(settings, "sacct", "--noheader", "--allocations", "--parsable2", "--format=JobID",
                    "--starttime=now")
    if isinstance(answer, str):
        return Check("slurm sacct", False, f"{answer}: a job that left squeue is known only to accounting; fix: "
                     "run slurmdbd and set AccountingStorageType=accounting_storage/slurmdbd in slurm.conf")
    return Check("slurm sacct", True, "answers (accounting is on)")


def _log_dir_check(settings: Settings) -> Check:
    """The worker reads each job's log and exit status from here; the node writes them. Prove a file can be
    made and removed (no-follow, exclusive), not only that the mode bits look right."""
    path = settings.slurm_logs
    name = f"slurm log dir {path}"
    fix = (f"fix: create it on storage every node mounts at the same path, writable by "
           f"{_user_name(os.geteuid())}, or set slurm_log_dir")
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        if settings.slurm_log_dir is None:  # <state_dir>/slurm: the first submission makes it
            return Check(name, False, "missing: the first dispatch creates it under the state dir, which every "
                         "node must then mount at the same path; set slurm_log_dir to shared storage otherwise",
                         required=False)
        return Check(name, False, f"missing (is the shared storage mounted?); {fix}")
    except OSError as exc:
        return Check(name, False, f"unreadable: {exc.strerror}; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        return Check(name, False, f"not a directory (a link or a file); {fix}")
    probe = path / f".doctor-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        return Check(name, False, f"this user cannot create a file there: {exc.strerror}; {fix}")
    os.close(fd)
    probe.unlink()
    return Check(name, True, "this user can create files there (the nodes must mount it at the same path)")


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)

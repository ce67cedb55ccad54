"""`lora-worker doctor`: the host checks behind dispatch, one line each, for an operator at a terminal.

Run it as the service user (the deployed `lora-worker` command does, even under sudo): what it checks is what
that user can do: exec the trainer, read the models, make a folder in the train root that arbo's user can read.

With `backend = "slurm"` the GPUs are Slurm's, not this host's: instead of NVML and the cards it asks the
cluster what the worker relies on (`sinfo` answers, the partition exists and is up, its nodes have GRES gpu,
`proctrack/cgroup` is on, `sacct` answers) and checks that the shared log directory takes a file from here.
Each failed line says how to fix it.
"""
from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from collections.abc import Iterator
from dataclasses import dataclass

from lora_worker.config import Settings
from lora_worker.errors import LoraWorkerError, NvmlUnavailable
from lora_worker.host.locks import gpu_lock_dir_mode
from lora_worker.host.nvml import Nvml
from lora_worker.ledger.migrate import current_revision, head_revision, verify_integrity
from lora_worker.host import sandbox
from lora_worker.host.trainer import missing_trainer_parts


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True  # a failed optional check is a warning, not a failure

    def line(self) -> str:
        mark = "ok" if self.ok else ("FAIL" if self.required else "warn")
        return f"[{mark:>4}] {self.name}: {self.detail}"


def run_checks(settings: Settings, nvml: Nvml) -> list[Check]:
    placement = slurm_checks(settings) if settings.backend == "slurm" else list(_gpu_checks(settings, nvml))
    return [*placement, *_trainer_checks(settings), *_disk_checks(settings), *identity_checks(settings)]


def identity_checks(settings: Settings) -> list[Check]:
    """What the service user can do on this host, and whether arbo can read what it writes."""
    return [_user_check(), _trainer_exec_check(settings), *_models_readable_checks(settings),
            _arbo_user_check(settings), _shared_folder_check(settings), _gpu_lock_dir_check(settings)]


def _gpu_checks(settings: Settings, nvml: Nvml) -> Iterator[Check]:
    try:
        readings = nvml.read()
    except NvmlUnavailable as exc:
        yield Check("nvml", False, exc.message)
        return
    yield Check("nvml", True, f"{len(readings)} device(s), PCI bus order")
    by_index = {r.index: r for r in readings}
    for index, profile in sorted(settings.devices.items()):
        reading = by_index.get(index)
        if reading is None:
            yield Check(f"device {index} ({profile.label})", False, "configured but not present")
        elif reading.error:
            yield Check(f"device {index} ({profile.label})", False, f"unreadable: {reading.error}")
        else:
            yield Check(f"device {index} ({profile.label})", True,
                        f"{reading.name}, {reading.pci_bus_id}, {reading.memory_free_mib}/{reading.memory_total_mib}"
                        f" MiB free, {len(reading.processes)} compute process(es), tiers {sorted(profile.tiers)}")


def _trainer_checks(settings: Settings) -> Iterator[Check]:
    missing = missing_trainer_parts(settings)
    problem = sandbox.probe(settings)
    yield Check("sandbox", problem is None, sandbox.describe(settings) + (f"; {problem}" if problem else ""))
    kind = "simulated (the test double: no GPU, nothing learned); " if settings.simulated else ""
    yield Check("trainer", not missing, kind + ("accelerate, sdxl_train_network.py and both CLIP tokenizers present"
                if not missing else "missing " + "; ".join(missing)))
    for directory in settings.model_dirs:
        yield Check(f"models dir {directory}", directory.is_dir(), "present" if directory.is_dir() else "missing")


def _disk_checks(settings: Settings) -> Iterator[Check]:
    for name, path in (("state dir", settings.state_dir), ("gpu lock dir", settings.gpu_locks)):
        ok = path.is_dir() and os.access(path, os.W_OK | os.X_OK)
        yield Check(f"{name} {path}", ok, "writable" if ok else "missing or not writable")
    yield _ledger_check(settings)
    yield _train_root_check(settings)


def _ledger_check(settings: Settings) -> Check:
    path = settings.database_path
    if not path.exists():
        return Check("ledger", False, f"{path} missing; run `lora-worker migrate`")
    try:
        verify_integrity(path)
    except LoraWorkerError as exc:
        return Check("ledger", False, exc.message)
    current, head = current_revision(path), head_revision()
    return Check("ledger", current == head, f"{path}, schema {current}" + ("" if current == head else f" (need {head})"))


def _train_root_check(settings: Settings) -> Check:
    root = settings.train_root
    try:
        st = root.stat()
    except OSError as exc:
        return Check(f"train root {root}", False, f"unreadable: {exc.strerror}")
    mode = stat.S_IMODE(st.st_mode)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    problems = []
    if not mode & stat.S_ISGID:
        problems.append("no setgid bit (new folders would not inherit the shared group)")
    if mode & 0o070 != 0o070:
        problems.append("the group cannot read, write and enter it")
    if mode & 0o007:
        problems.append("it is open to others")
    if not os.access(root, os.W_OK | os.X_OK):
        problems.append("this user cannot write to it")
    detail = f"group {group}, mode {mode:04o}" + ("; " + "; ".join(problems) if problems else "")
    return Check(f"train root {root}", not problems, detail)


def _user_check() -> Check:
    name = _user_name(os.geteuid())
    if os.geteuid() == 0:
        return Check("running as", False, "root: every access check below passes for root; run it as the service "
                     "user (the deployed `lora-worker` command does)", required=False)
    return Check("running as", True, f"{name} (uid {os.geteuid()})")


def _trainer_exec_check(settings: Settings) -> Check:
    script = settings.accelerate
    name = f"trainer exec {script}"
    if not os.access(script, os.R_OK | os.X_OK):
        return Check(name, False, f"{_user_name(os.geteuid())} cannot read and execute it")
    interpreter = _interpreter(script)
    if interpreter is not None and not os.access(interpreter, os.X_OK):
        return Check(name, False, f"its interpreter {interpreter} is not executable by {_user_name(os.geteuid())}")
    return Check(name, True, "this user can run it" + (f" (interpreter {interpreter})" if interpreter else ""))


def _models_readable_checks(settings: Settings) -> list[Check]:
    checks = []
    for directory in settings.model_dirs:
        name = f"models readable {directory}"
        if not os.access(directory, os.R_OK | os.X_OK):
            checks.append(Check(name, False, "this user cannot list it"))
            continue
        models = sorted(p for p in directory.rglob("*.safetensors") if p.is_file())
        unreadable = [p for p in models if not os.access(p, os.R_OK)]
        readable = f"{len(models) - len(unreadable)}/{len(models)} checkpoint(s) readable"
        checks.append(Check(name, not unreadable, readable
                            + (f"; not: {', '.join(p.name for p in unreadable[:5])}" if unreadable else "")))
    return checks


def _arbo_user_check(settings: Settings) -> Check:
    if settings.arbo_user is None:
        return Check("arbo's user", False, "not set (arbo_user): nobody checked to read what the trainer writes",
                     required=False)
    name = f"arbo's user {settings.arbo_user}"
    try:
        arbo = pwd.getpwnam(settings.arbo_user)
        group = grp.getgrgid(settings.train_root.stat().st_gid)
    except KeyError:
        return Check(name, False, "no such user, or the train root's group has no name, on this host")
    except OSError as exc:
        return Check(name, False, f"the train root is unreadable: {exc.strerror}")
    member = arbo.pw_gid == group.gr_gid or settings.arbo_user in group.gr_mem
    return Check(name, member, f"uid {arbo.pw_uid}, " + (f"in {group.gr_name}" if member else
                                                         f"NOT in {group.gr_name}: it cannot read the LoRAs"))


def _shared_folder_check(settings: Settings) -> Check:
    """Make a folder as the trainer would, and see whether arbo's user could read it."""
    name = f"train root shared {settings.train_root}"
    required = settings.arbo_user is not None  # shared with whom, else: a checkout's own train root
    try:
        folder = Path(tempfile.mkdtemp(prefix=".doctor-", dir=settings.train_root))
    except OSError as exc:
        return Check(name, False, f"this user cannot create a folder there: {exc.strerror}", required)
    try:
        st, root_gid = folder.stat(), settings.train_root.stat().st_gid
        os.chmod(folder, 0o777 & ~_umask())  # mkdtemp makes 0700; a trainer's mkdir gets the umask
        mode = stat.S_IMODE(folder.stat().st_mode)
    finally:
        folder.rmdir()
    group = _group_name(st.st_gid)
    if st.st_gid != root_gid:
        return Check(name, False, f"a new folder is group {group}, not the root's {_group_name(root_gid)} "
                     "(no setgid bit?)", required)
    if mode & 0o050 != 0o050:
        return Check(name, False, f"a new folder is mode {mode:04o}: its group cannot read it (the umask?)", required)
    return Check(name, True, f"a new folder is group {group}, mode {mode:04o}: the group can read it")


def _gpu_lock_dir_check(settings: Settings) -> Check:
    path, want = settings.gpu_locks, gpu_lock_dir_mode(settings)
    who = "every user" if settings.gpu_lock_everyone else f"group {settings.gpu_lock_group}"
    name = f"gpu interlock {path}"
    if settings.gpu_lock_dir is None:  # a checkout's own <state_dir>/gpu-locks: no other trainer looks there
        return Check(name, False, "private to this worker (gpu_lock_dir unset): no other trainer can join",
                     required=False)
    try:
        st = os.stat(path)
    except OSError as exc:
        return Check(name, False, f"unreadable: {exc.strerror}")
    mode, group = stat.S_IMODE(st.st_mode), _group_name(st.st_gid)
    problems = [f"mode {mode:04o}, not {want:04o}"] if mode != want else []
    if not settings.gpu_lock_everyone and group != settings.gpu_lock_group:
        problems.append(f"group {group}, not {settings.gpu_lock_group}")
    if problems:
        return Check(name, False, "; ".join(problems) + f": not every trainer of {who} can join")
    return Check(name, True, f"mode {mode:04o}, group {group}: {who} can join")


# -- Slurm ------------------------------------------------------------------------------------------------------

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
        return Check(name, False, f"srun cannot run here ({exc}); the nodes' sandbox is unchecked", required=False)
    said = (done.stdout.strip() or done.stderr.strip()).splitlines()
    last = said[-1][:300] if said else f"srun exited {done.returncode}"
    if done.returncode == 0 and last == "ok":
        return Check(name, True, f"sandbox {settings.sandbox} works on a node, with {sys.executable}")
    if "bwrap" in last or "namespaces" in last or "sandbox" in last:
        return Check(name, False, f"{last}; every job would end launch_error there; fix: install bubblewrap on "
                     "every node (apt-get install bubblewrap) and allow unprivileged user namespaces")
    busy = "allocat" in last.lower()  # no node free within --immediate: unchecked, not failed
    return Check(name, False, f"{last}; fix: " + ("run doctor again when a node of the partition is free" if busy
                 else f"install this worker at {sys.executable} on the nodes (shared storage)"), required=not busy)


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


def _interpreter(script: Path) -> str | None:
    try:
        with open(script, "rb") as fh:
            first = fh.readline(256)
    except OSError:
        return None
    parts = first[2:].split() if first.startswith(b"#!") else []
    return parts[0].decode(errors="replace") if parts else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)

"""`lora-worker doctor`: the host checks behind dispatch, one line each, for an operator at a terminal.

Run it as the service user (the deployed `lora-worker` command does, even under sudo): what it checks is what
that user can do: exec the trainer, read the models, make a folder in the train root that arbo's user can read.

Where the backend of new jobs does not place them on this host (Slurm), the GPUs are the scheduler's: instead of
NVML and the cards it asks the cluster what the worker relies on (doctor_slurm.py: `sinfo` answers, the partition
exists and is up, its nodes have GRES gpu, `proctrack/cgroup` is on, `sacct` answers, the shared log directory
takes a file from here), then the backend's own deep checks (the controller, usable nodes for each tier, and with
`--strict` the opt-in probe job). Each failed line says how to fix it; what could not be checked says so, and
fails `--strict`.
"""
from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile
from pathlib import Path
from collections.abc import Iterator

from lora_worker.backends import backend_for
from lora_worker.config import Settings
from lora_worker.errors import LoraWorkerError, NvmlUnavailable
from lora_worker.host.locks import gpu_lock_dir_mode
from lora_worker.host.nvml import GpuReading, Nvml
from lora_worker.ledger.migrate import current_revision, head_revision, verify_integrity
from lora_worker.host import sandbox
from lora_worker.host.trainer import missing_trainer_parts
from lora_worker.checks import Check
from lora_worker.dispatch.readiness import deep_checks, sandbox_check
from lora_worker.ops.doctor_slurm import slurm_checks
from lora_worker.webhooks.probe import webhook_findings

__all__ = ["Check", "run_checks", "identity_checks", "slurm_checks"]


def run_checks(settings: Settings, nvml: Nvml, *, strict: bool = False) -> list[Check]:
    """Every check. `strict` adds the one that takes seconds: the trainer's own interpreter, started in the
    job's sandbox, imports torch, sees CUDA and loads bitsandbytes (dispatch/readiness.py)."""
    here = backend_for(settings).places_here  # this host's GPUs, or the scheduler's
    placement = list(_gpu_checks(settings, nvml)) if here else slurm_checks(settings)
    # On Slurm the jobs' sandbox is the nodes' (doctor_slurm.py asks a node); here, only bwrap's own probe.
    deep = deep_checks(settings, nvml, trainer=strict)
    if not here:
        deep.insert(0, sandbox_check(settings, sandbox.probe))
    return [*placement, *deep, *_trainer_checks(settings), *_disk_checks(settings), *identity_checks(settings),
            *token_file_check(settings), *(Check(name, ok, detail) for name, ok, detail in webhook_findings(settings))]


def token_file_check(settings: Settings, environ: dict[str, str] | None = None) -> list[Check]:
    """The API token file (api_token_file, else the installer's, beside the config file) must be private: a
    token others on the host can read is anyone's key to the API. No line when there is no token file."""
    environ = dict(os.environ) if environ is None else environ
    beside_config = Path(environ["LORA_WORKER_CONFIG"]).parent / "api_token" if environ.get("LORA_WORKER_CONFIG") \
        else None
    path = settings.api_token_file or beside_config
    try:
        st = os.lstat(path) if path else None
    except OSError:
        st = None
    if path is None or st is None:
        return [] if path is None or path == beside_config else [Check("api token", False, f"{path} is missing")]
    if not stat.S_ISREG(st.st_mode):
        return [Check("api token", False, f"{path} is not a regular file (a link or other kind)")]
    if st.st_mode & 0o007:
        return [Check("api token", False, f"{path} ({stat.filemode(st.st_mode)}) is readable by every user on "
                                          f"this host: sudo chmod 0600 {path}, then rotate the token (it may have "
                                          "been read)")]
    return [Check("api token", True, f"{path} ({stat.filemode(st.st_mode)}), not readable by others")]


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
        elif reading.processes is None and not settings.allow_cotenancy:
            yield Check(f"device {index} ({profile.label})", False, f"compute processes unreadable "
                        f"({reading.processes_error}): POST /train refuses this device (503 nvml_unavailable)")
        else:
            yield Check(f"device {index} ({profile.label})", True,
                        f"{reading.name}, {reading.pci_bus_id}, {reading.memory_free_mib}/{reading.memory_total_mib}"
                        f" MiB free, {_process_count(reading)} compute process(es), tiers {sorted(profile.tiers)}")


def _trainer_checks(settings: Settings) -> Iterator[Check]:
    missing = missing_trainer_parts(settings)
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
    need = "" if current == head else f" (need {head})"
    return Check("ledger", current == head, f"{path}, schema {current}{need}")


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


def _process_count(reading: GpuReading) -> str:
    return str(len(reading.processes)) if reading.processes is not None else f"unknown ({reading.processes_error})"

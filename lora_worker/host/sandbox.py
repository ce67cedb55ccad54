"""The trainer's sandbox: bubblewrap, so that only the job's paths exist for it.

The train root is shared with a party we do not trust, and the trainer opens what its argv names hours after
dispatch checked it. Inside the sandbox the host is reduced to: read-only the dataset, the base model,
sd-scripts, the trainer's venv (and the interpreter it runs on), the tokenizers and /usr; read-write the output
dir; the GPU device nodes, a fresh /proc, the /sys parts CUDA and NVML read, and private tmpfs for /tmp,
/dev/shm and HOME. No home directory, other train id, state dir (ledger, logs, token) or network exists in it.

It is also how every process of a job can be found and killed: `--unshare-pid` puts the job in its own PID
namespace, whose init is bwrap; `--die-with-parent` makes bwrap die with the supervisor, and when the
namespace's init dies the kernel kills every process in it. A grandchild that called setsid and re-exec'd
itself under another name is still in the namespace, so it dies with it, supervisor or not.

The job's own directories (dataset, its kohya folder, output) and its dataset config (a file of the worker's, in the
state dir a tmpfs hides otherwise) are bound through the very descriptors the
pre-exec check opened and compared (run/prelaunch.py, `--ro-bind-fd`/`--bind-fd`), never by name again: a
rename or a link planted between the check and the mount changes nothing that is mounted (bwrap itself
compares the mounted directory with the descriptor). The operator's directories are bound by path, but never
one that would open the sandbox up (lora_worker/binds.py). Run as root, the trainer gets a user namespace of its own
(uid and gid 65534 in it, no capability on the host) and a read-only /proc/sys.

`wrap` is pure: what it needs from the host (the interpreter's prefix, which device nodes exist, whether we
are root) is read by `host_facts` first, so the command can be tested for any host.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.errors import SandboxUnavailable
from lora_worker import binds
from lora_worker.binds import USR_ALIASES

BWRAP = "bwrap"
NONE = "none"
SANDBOXES = (BWRAP, NONE)  # the values of the `sandbox` setting
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"

# Read by the dynamic loader (libcuda.so.1 is found through ld.so.cache: /usr/lib/<triplet> is not a default
# path), by Python's pwd/locale/time modules, and by /usr/bin links that go through /etc/alternatives.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf",
             "alternatives")
# What the CUDA runtime and NVML read in sysfs: PCI devices and their driver, NUMA topology, CPU lists, the
# nvidia module's parameters. Not /sys/fs (cgroups) or /sys/kernel.
SYS_PARTS = ("/sys/devices", "/sys/bus", "/sys/class", "/sys/dev", "/sys/module")
DEVICE_GLOBS = ("/dev/nvidia*", "/dev/dri")  # nvidia0…N, nvidiactl, nvidia-uvm(-tools), nvidia-modeset, nvidia-caps
# Who the trainer is inside its user namespace when the service runs as root: `nobody`, never uid 0.
SANDBOX_UID = SANDBOX_GID = 65534


@dataclass(frozen=True)
class JobPaths:
    """The paths of one job, as dispatch resolved and stored them."""

    dataset_dir: Path
    base_model_path: Path
    output_dir: Path
    read_only: tuple[Path, ...] = ()  # the worker's own files the argv names (`argv_files`), bound read-only


# The worker's own files a trainer's argv may name (the sample prompts, dispatch/samples.py): written in the state
# dir (or the storage a Slurm node shares), which the sandbox otherwise hides under a tmpfs.
ARGV_FILES = ("--sample_prompts=",)


def argv_files(argv: list[str]) -> tuple[Path, ...]:
    return tuple(Path(a.split("=", 1)[1]) for a in argv if a.startswith(ARGV_FILES))


@dataclass(frozen=True)
class HostFacts:
    """What the sandbox command depends on besides the job and the settings."""

    bwrap: str | None  # the bwrap executable, None when not installed
    interpreter_dirs: tuple[Path, ...]  # the launcher's interpreter: its venv and its installation prefix
    device_nodes: tuple[Path, ...]  # GPU device nodes present on this host
    usr_aliases: tuple[tuple[str, str | None], ...]  # ("lib", "usr/lib") for a symlink, ("lib", None) for a dir
    etc_files: tuple[Path, ...]
    sys_parts: tuple[Path, ...]
    as_root: bool = False  # the service runs as uid 0: the trainer gets a user namespace (see wrap)


def bwrap_executable() -> str | None:
    return shutil.which(BWRAP, path="/usr/bin:/bin:/usr/local/bin")


def bwrap_for(settings: Settings) -> str | None:
    """The settings' bwrap (`bwrap_path`) when it names an executable, else the one installed, else None."""
    if settings.bwrap_path is not None:
        return str(settings.bwrap_path) if os.access(settings.bwrap_path, os.X_OK) else None
    return bwrap_executable()


def unavailable(settings: Settings) -> str | None:
    """Why the configured sandbox cannot be used (a sentence), or None when it can."""
    if settings.sandbox == NONE:
        return None
    if bwrap_for(settings) is None:
        where = f" at {settings.bwrap_path}" if settings.bwrap_path is not None else ""
        return f"the trainer sandbox ({BWRAP}) is not installed{where}: {INSTALL_HINT}"
    return bind_problem(settings, host_facts(settings))


def bind_problem(settings: Settings, facts: HostFacts) -> str | None:
    """Why one of the operator's directories may not be bound (it would open the sandbox up), or None."""
    holds = binds.protected(settings)
    for path in _operator_binds(settings, facts):
        if problem := binds.too_wide(path, holds):
            return (f"the sandbox would bind {problem} (from the settings 'accelerate', 'sd_scripts_dir', "
                    "'tokenizer_cache_dir' or the launcher's interpreter); point them at the trainer's own "
                    "installation")
    return None


def require_sandbox(settings: Settings) -> None:
    """Refuse a job (503) that would run without the sandbox the settings ask for."""
    problem = unavailable(settings)
    if problem:
        raise SandboxUnavailable(problem[0].upper() + problem[1:] + ".", sandbox=settings.sandbox)


def describe(settings: Settings) -> str:
    """For /healthz and doctor: which sandbox is in force."""
    if settings.sandbox == NONE:
        return "none (the trainer sees the whole host; set sandbox = \"bwrap\")"
    problem = unavailable(settings)
    if problem:
        return f"unavailable: {problem}"
    as_root = f"; run as root: the trainer is uid {SANDBOX_UID} in a user namespace" if os.geteuid() == 0 else ""
    return f"{BWRAP} ({bwrap_for(settings)}){as_root}"


def host_facts(settings: Settings) -> HostFacts:
    return HostFacts(
        bwrap=bwrap_for(settings),
        interpreter_dirs=binds.interpreter_dirs(settings.accelerate),
        device_nodes=tuple(Path(p) for pattern in DEVICE_GLOBS for p in sorted(glob.glob(pattern))),
        usr_aliases=tuple(_usr_alias(name) for name in USR_ALIASES if os.path.lexists(f"/{name}")),
        etc_files=tuple(Path("/etc", name) for name in ETC_FILES if os.path.exists(f"/etc/{name}")),
        sys_parts=tuple(Path(p) for p in SYS_PARTS if os.path.isdir(p)),
        as_root=os.geteuid() == 0,
    )


def wrap(argv: list[str], job: JobPaths, settings: Settings, facts: HostFacts,
         held: Mapping[Path, int] | None = None) -> list[str]:
    """The command that runs `argv` in the job's sandbox (or `argv` itself with sandbox = "none").

    `held` are the descriptors the pre-exec check opened, by the path they were reached at: the dataset and
    the output dir must be among them (a job's directory is never bound by name); the caller passes them to
    bwrap (pass_fds) and closes them once it has started."""
    if settings.sandbox == NONE:
        return list(argv)
    if facts.bwrap is None:
        raise FileNotFoundError(f"no {BWRAP} executable: {INSTALL_HINT}")
    held = dict(held or {})
    missing = [str(p) for p in (job.dataset_dir, job.output_dir) if p not in held]
    if missing:
        raise ValueError(f"not checked before the mount: {', '.join(missing)}")
    if problem := bind_problem(settings, facts):
        raise ValueError(problem)
    cmd = [facts.bwrap,
           "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try",
           "--die-with-parent", "--cap-drop", "ALL"]
    if facts.as_root:
        # bwrap run by root makes no user namespace: the trainer would be the host's root. In one of its own
        # it is nobody, with no capability on the host.
        cmd += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
    cmd += _host_mounts(settings, facts) + _job_mounts(job, settings, facts, held)
    cmd += ["--chdir", str(settings.sd_scripts_dir), "--"]
    return cmd + list(argv)


def _host_mounts(settings: Settings, facts: HostFacts) -> list[str]:
    """What of the host every job's sandbox has: the system, the GPU, and private scratch space."""
    cmd = ["--ro-bind", "/usr", "/usr"]
    for name, target in facts.usr_aliases:
        cmd += ["--symlink", target, f"/{name}"] if target else ["--ro-bind", f"/{name}", f"/{name}"]
    for path in facts.etc_files:
        cmd += ["--ro-bind", str(path), str(path)]
    # /proc/sys read-only: its files belong to the host's root, which a namespace made by root still maps.
    cmd += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev", "--tmpfs", "/dev/shm"]
    for node in facts.device_nodes:
        cmd += ["--dev-bind", str(node), str(node)]
    for part in facts.sys_parts:
        cmd += ["--ro-bind", str(part), str(part)]
    # Private and empty: scratch space, and HOME/HF_HOME (the state dir's path, none of its files).
    for scratch in _unique([Path("/tmp"), settings.state_dir, settings.hf_home_dir]):
        cmd += ["--tmpfs", str(scratch)]
    return cmd


def _job_mounts(job: JobPaths, settings: Settings, facts: HostFacts, held: Mapping[Path, int]) -> list[str]:
    """The installation by path, the job's checked directories by descriptor (the output dir read-write)."""
    mounts = [(p, "--ro-bind") for p in (*_operator_binds(settings, facts), job.base_model_path)]
    mounts += [(p, "--ro-bind") for p in held if p != job.output_dir]  # the dataset, its kohya folder, its config
    mounts += [(p, "--ro-bind") for p in job.read_only]  # the sample prompts, over the state dir's tmpfs
    mounts.append((job.output_dir, "--bind"))
    cmd: list[str] = []
    # Shallow paths first, so a deeper bind (the output dir inside a read-only tree) is mounted over them.
    for path, how in sorted(_unique_binds(mounts), key=lambda b: (len(b[0].parts), str(b[0]))):
        cmd += [how + "-fd", str(held[path]), str(path)] if path in held else [how, str(path), str(path)]
    return cmd


def wait_status(returncode: int | None, settings: Settings) -> int | None:
    """The launcher's own wait status. bwrap exits with its command's code, or 128 + N when a signal N killed
    the command; as Popen would report it, that is -N. (bwrap killed itself is negative already.)"""
    if settings.sandbox == BWRAP and returncode is not None and 128 < returncode < 128 + 65:
        return -(returncode - 128)
    return returncode


def probe(settings: Settings, timeout_s: float = 10.0) -> str | None:
    """For `doctor`: whether bwrap can make its namespaces here (unprivileged user namespaces, no seccomp or
    AppArmor rule against them); None when `true` runs in a sandbox, else what went wrong."""
    problem = unavailable(settings)
    if problem or settings.sandbox == NONE:
        return problem
    cmd = [str(bwrap_for(settings)), "--unshare-pid", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
           "--dev", "/dev", "--", "true"]
    if os.geteuid() == 0:  # what a job run as root gets (wrap): the user namespace must work too
        cmd[1:1] = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)  # noqa: S603 - fixed argv
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap cannot run: {exc}"
    if done.returncode != 0:
        return f"bwrap cannot make its namespaces: {done.stderr.decode(errors='replace').strip()[:300]}"
    return None


# bwrap's probe, once per executable: the service asks at start-up (readiness.DeepHealth), dispatch reads it.
_probed: dict[str | None, str | None] = {}
_probe_lock = threading.Lock()


def probed_problem(settings: Settings) -> str | None:
    """`probe`'s answer for this bwrap, made once per process and kept: a host whose kernel or AppArmor forbids
    the namespaces does not change its mind between two requests, and dispatch must not pay 10 ms a POST."""
    if settings.sandbox == NONE:
        return None
    key = bwrap_for(settings)
    with _probe_lock:
        if key not in _probed:
            _probed[key] = probe(settings)
        return _probed[key]


def require_namespaces(settings: Settings) -> None:
    """Refuse a job (503) whose sandbox would fail to start: every such job would end `trainer_crashed`."""
    problem = probed_problem(settings)
    if problem:
        raise SandboxUnavailable(f"The trainer sandbox cannot start on this host: {problem}.",
                                 sandbox=settings.sandbox)


def _operator_binds(settings: Settings, facts: HostFacts) -> list[Path]:
    """The installation's directories the sandbox binds read-only (not those under /usr: already there)."""
    found = [*facts.interpreter_dirs, _venv_of(settings.accelerate), settings.sd_scripts_dir,
             settings.tokenizer_cache_dir]
    return [p for p in _unique(found) if not binds.already_present(p)]


def _venv_of(launcher: Path) -> Path:
    """`<venv>/bin/accelerate` → `<venv>`."""
    return launcher.parent.parent


def _usr_alias(name: str) -> tuple[str, str | None]:
    path = f"/{name}"
    return (name, os.readlink(path)) if os.path.islink(path) else (name, None)


def _unique(paths: list[Path]) -> list[Path]:
    return list(dict.fromkeys(paths))


def _unique_binds(binds: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    chosen: dict[Path, str] = {}
    for path, how in binds:
        if chosen.get(path) != "--bind":  # the same path both ways: writable wins (only the output dir is)
            chosen[path] = how
    return list(chosen.items())

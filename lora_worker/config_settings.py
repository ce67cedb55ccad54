"""The worker's settings: one frozen dataclass of everything it reads from its environment, each field's default,
and the checks that refuse a combination at start-up. Where the values come from is lora_worker/config.py's.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from lora_worker import binds
from lora_worker.config_slurm import DEFAULT_SLURM_RESOURCES, SlurmResources, resources_problem
from lora_worker.config_tables import (
    BACKENDS,
    DEFAULT_DEVICES,
    DEFAULT_DISK_MIB,
    DEFAULT_SLURM_MEM_MB,
    DEFAULT_SLURM_TIME_LIMIT_MIN,
    DEFAULT_STALL_LIMITS_S,
    SAMPLE_STEPS,
    SAVE_EVERY_N_STEPS,
    SIMULATED,
    TIERS,
    TRAINER_KINDS,
    WEBHOOK_EVENT_TYPES,
    DeviceProfile,
    Tier,
)
from lora_worker.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
SANDBOXES = ("bwrap", "none")
RIG_TIER_KEYS = frozenset({"max_train_steps", "network_dim", "resolution", "save_every_n_steps", "sample_steps"})


@dataclass(frozen=True)
class Settings:
    """Everything the worker reads from its environment, resolved once at start-up."""

    state_dir: Path = REPO_ROOT / "var"
    train_root: Path = Path("/worktank/arbo/train")
    model_dirs: tuple[Path, ...] = (Path("/worktank/models"),)
    # The trainer installation (fluxgym's venv and its sd-scripts checkout).
    accelerate: Path = Path("/opt/fluxgym/.venv/bin/accelerate")
    sd_scripts_dir: Path = Path("/opt/fluxgym/sd-scripts")
    tokenizer_cache_dir: Path = Path("/opt/fluxgym/tokenizers")
    trainer_kind: str = "sd-scripts"  # or "simulated": labelled on /healthz, in doctor and in each run log
    hf_home: Path | None = None  # worker-owned; defaults to <state_dir>/hf
    cpu_threads: int = 4
    child_path: str = "/usr/local/bin:/usr/bin:/bin"
    devices: Mapping[int, DeviceProfile] = field(default_factory=lambda: DEFAULT_DEVICES)
    disk_mib: Mapping[str, int] = field(default_factory=lambda: DEFAULT_DISK_MIB)
    stall_limits_s: Mapping[str, float] = field(default_factory=lambda: DEFAULT_STALL_LIMITS_S)
    # Supervision.
    cancel_grace_s: float = 20.0
    progress_interval_s: float = 1.0
    launch_grace_s: float = 30.0
    log_head_bytes: int = 1 << 20
    log_tail_bytes: int = 4 << 20
    busy_timeout_s: float = 5.0
    # The supervisor must never stop reading the trainer's pipes for long: its progress writes give up fast
    # (and are retried a tick later) instead of waiting out a lock.
    supervisor_busy_timeout_s: float = 0.25
    retention_days: int = 90
    # Reconcile resumes a job a reboot cut off, once, from its newest good state (dispatch/resume.py
    # `follow_up`). Off by default: arbo's lease decides what the GPU does next; off, the job is only marked
    # resumable (an event) for a client's POST /train/<id>/resume.
    auto_resume: bool = False
    # GPUs.
    nvml_timeout_s: float = 2.0
    nvml_fake_file: Path | None = None  # a JSON description of GPUs, for tests and demos without a GPU
    allow_cotenancy: bool = False
    tts_device_index: int = 0
    tts_process_pattern: str = r"(?i)\btts\b|tts[-_]?server|xtts|coqui|piper|kokoro|f5[-_]tts"
    gpu_lock_dir: Path | None = None  # host-wide convention; defaults to <state_dir>/gpu-locks
    # Who may join the interlock: the members of `gpu_lock_group` (directory 3770, files 0660), or, with
    # `gpu_lock_everyone`, every user on the host (1777, 0666). The installer's tmpfiles entry makes the
    # directory so; `lora-worker doctor` checks it.
    gpu_lock_group: str = "arbotrain"
    gpu_lock_everyone: bool = False
    # arbo's user on this host (its container runs as this uid): `doctor` checks it can read what we write.
    # Unset in a checkout; the installer writes the seed's `lkraven` (or its --arbo-user) into the deployed file.
    arbo_user: str | None = None
    # HTTP. `bind` is what gunicorn listens on (comma-separated, as gunicorn's --bind); gunicorn tells the app
    # the addresses it really serves, so a worker without a token can insist on loopback.
    bind: str = "127.0.0.1:8203"
    api_token_file: Path | None = None  # without systemd; `$CREDENTIALS_DIRECTORY/api_token` wins when present
    max_body_bytes: int = 64 * 1024
    long_poll_slots: int = 4  # below gunicorn's 8 threads: waiting clients never starve a cancel
    # The trainer's sandbox (lora_worker.host.sandbox): "bwrap" (bubblewrap; only the job's paths exist for the
    # trainer, and its PID namespace dies with the supervisor) or "none". bwrap is the default and what the
    # deployed unit insists on; "none" is only ever set explicitly (`make run` does, and says so, on a machine
    # without bubblewrap).
    sandbox: str = "bwrap"
    bwrap_path: Path | None = None  # the bwrap executable; unset: the first in /usr/bin, /bin, /usr/local/bin
    # Where the GPU device nodes are (/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidiaN): the deep health check
    # looks for them here. Only a test moves it.
    dev_root: Path = Path("/dev")
    # Where jobs run (backends.py): "local", this host's detached supervisor, one job at a time; or "slurm",
    # sbatch on a cluster that sees the same train root and model paths, followed by one poller process
    # (slurm/), with up to `max_active_jobs` queued or running at once (slots slurm-0 … slurm-N-1).
    backend: str = "local"
    max_active_jobs: int = 8
    slurm_partition: str = "gpu"
    slurm_log_dir: Path | None = None  # shared storage the node writes <id>.log and <id>.rc to; <state_dir>/slurm
    slurm_bin_dir: Path | None = None  # where sbatch, squeue, sacct, scontrol and scancel are; unset: PATH
    slurm_time_limit_min: Mapping[str, int] = field(default_factory=lambda: DEFAULT_SLURM_TIME_LIMIT_MIN)
    slurm_mem_mb: Mapping[str, int] = field(default_factory=lambda: DEFAULT_SLURM_MEM_MB)
    slurm_poll_interval_s: float = 2.0
    # tier -> SlurmResources (gres, constraint, train_batch_size, mixed_precision); tiers not named keep the default.
    slurm_resources: Mapping[str, SlurmResources] = field(default_factory=lambda: DEFAULT_SLURM_RESOURCES)
    # The deep health check's probe job (slurm/health.py): srun starts the trainer probe on a node, in the job's
    # sandbox, with each tier's GPU. Off by default: it takes a node and its GPU for up to a few minutes at each
    # start of the service and each `doctor --strict`; off, the check says "not checked" and `doctor --strict` fails.
    slurm_probe_job: bool = False
    # Webhooks (lora_worker/webhooks/): arbo's endpoint, from here only (a request may only opt out or choose
    # event types). Unset: no job subscribes, and nothing is sent. The secret is a file, never a setting's value:
    # `$CREDENTIALS_DIRECTORY/webhook_secret` (LoadCredential=) wins over `webhook_secret_file`.
    webhook_url: str | None = None
    webhook_secret_file: Path | None = None
    webhook_event_types: str = ""  # comma-separated; empty: every type (ledger/outbox.py EVENT_TYPES)
    webhook_progress_interval_s: float = 30.0
    webhook_give_up_s: float = 24 * 3600.0
    webhook_connect_timeout_s: float = 3.0
    webhook_read_timeout_s: float = 10.0
    # Test-only, for the real trainer's CPU rig (tests/rig/): a tier's size replaced, e.g. {"fast":
    # {"max_train_steps": 7, "network_dim": 4, "resolution": 256, "save_every_n_steps": 2}}; `sample_steps`: fewer
    # sampler steps for a job's sample passes (the rig, bench/gpu_check). Refused in a config file and never
    # read from the environment: only code that builds Settings itself (a test, the GPU check) sets it, so a
    # deployed worker trains config_tables' sizes and nothing else.
    rig_tier_sizes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_rig_tier_sizes()
        if self.sandbox not in SANDBOXES:
            raise ConfigError(f"setting 'sandbox': {self.sandbox!r} is not one of {', '.join(SANDBOXES)}")
        if self.trainer_kind not in TRAINER_KINDS:
            raise ConfigError(f"setting 'trainer_kind': {self.trainer_kind!r} is not one of {list(TRAINER_KINDS)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"setting 'backend': {self.backend!r} is not one of {list(BACKENDS)}")
        if self.backend == "slurm":
            self._check_slurm()
            if problem := resources_problem(self.slurm_resources):
                raise ConfigError(f"setting 'slurm_resources': {problem}")
        if self.webhook_url is not None:
            self._check_webhooks()
        if self.sandbox == "bwrap":
            self._check_sandbox_binds()

    def _check_webhooks(self) -> None:
        """A target the sender can reach as written: http or https, a host, no credentials in the URL."""
        url = urlsplit(self.webhook_url or "")
        if url.scheme not in ("http", "https") or not url.hostname or url.username or url.password:
            raise ConfigError(f"setting 'webhook_url': {self.webhook_url!r} is not an http(s) URL with a host and "
                              "no user or password in it (the secret signs each request instead)")
        unknown = set(self.webhook_types) - set(WEBHOOK_EVENT_TYPES)
        if unknown:
            raise ConfigError(f"setting 'webhook_event_types': unknown {sorted(unknown)}; "
                              f"known: {', '.join(WEBHOOK_EVENT_TYPES)}")
        for name in ("webhook_progress_interval_s", "webhook_give_up_s", "webhook_connect_timeout_s",
                     "webhook_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"setting {name!r}: {getattr(self, name)} must be above 0")

    def _check_rig_tier_sizes(self) -> None:
        for tier, sizes in self.rig_tier_sizes.items():
            if tier not in TIERS or not set(sizes) <= RIG_TIER_KEYS or any(int(v) < 1 for v in sizes.values()):
                raise ConfigError(f"setting 'rig_tier_sizes': {tier!r}: {dict(sizes)} is not a known tier with "
                                  f"whole numbers above 0 for some of {sorted(RIG_TIER_KEYS)}")

    @property
    def tiers(self) -> Mapping[str, Tier]:
        """config_tables.TIERS, or, for a test on the rig, with `rig_tier_sizes` replacing some sizes."""
        if not self.rig_tier_sizes:
            return TIERS
        sizes = self.rig_tier_sizes
        return MappingProxyType({name: _resized(tier, sizes.get(name, {})) for name, tier in TIERS.items()})

    def save_every_n_steps(self, tier: str) -> int:
        return int(self.rig_tier_sizes.get(tier, {}).get("save_every_n_steps", SAVE_EVERY_N_STEPS[tier]))

    def sample_steps(self, tier: str) -> int:
        """The sampler steps of each sample image (config_tables.SAMPLE_STEPS; a rig test's fewer)."""
        return int(self.rig_tier_sizes.get(tier, {}).get("sample_steps", SAMPLE_STEPS))

    @property
    def webhook_types(self) -> tuple[str, ...]:
        """The event types a job sends unless its request chose fewer."""
        chosen = tuple(t.strip() for t in self.webhook_event_types.split(",") if t.strip())
        return chosen or WEBHOOK_EVENT_TYPES


    def _check_sandbox_binds(self) -> None:
        """The installation's directories the sandbox binds: never `/`, a system directory or the state dir
        because a setting points near it (lora_worker/binds.py; the launcher's interpreter is checked at dispatch)."""
        holds = binds.protected(self)
        for name, path in (("accelerate", self.accelerate.parent.parent), ("sd_scripts_dir", self.sd_scripts_dir),
                           ("tokenizer_cache_dir", self.tokenizer_cache_dir)):
            if not binds.already_present(path) and (problem := binds.too_wide(path, holds)):
                raise ConfigError(f"setting {name!r}: the trainer's sandbox would bind {problem}, which opens it up; "
                                  "point it at the trainer's own installation")

    def _check_slurm(self) -> None:
        """The Slurm settings a submission and the poller rely on, refused at start-up rather than at sbatch."""
        if not 1 <= self.max_active_jobs <= 999:  # slot names (`slurm-<k>`) fit the 16-character slot column
            raise ConfigError(f"setting 'max_active_jobs': {self.max_active_jobs} is not between 1 and 999")
        if not self.slurm_partition or any(c.isspace() or c in ",=" for c in self.slurm_partition):
            raise ConfigError(f"setting 'slurm_partition': {self.slurm_partition!r} is not a partition name")
        if not self.slurm_poll_interval_s > 0:
            raise ConfigError(f"setting 'slurm_poll_interval_s': {self.slurm_poll_interval_s} must be above 0")
        for name in ("slurm_time_limit_min", "slurm_mem_mb"):
            _check_tier_minimums(name, getattr(self, name))

    @property
    def simulated(self) -> bool:
        """Whether the trainer is the test double: the worker then trains nothing, and says so everywhere."""
        return self.trainer_kind == SIMULATED

    @property
    def database_path(self) -> Path:
        return self.state_dir / "ledger.sqlite3"

    @property
    def lock_dir(self) -> Path:
        return self.state_dir / "locks"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def slurm_logs(self) -> Path:
        return self.slurm_log_dir or self.state_dir / "slurm"

    @property
    def hf_home_dir(self) -> Path:
        return self.hf_home or self.state_dir / "hf"

    @property
    def gpu_locks(self) -> Path:
        return self.gpu_lock_dir or self.state_dir / "gpu-locks"

    @property
    def train_script(self) -> Path:
        return self.sd_scripts_dir / "sdxl_train_network.py"

    def device(self, index: int) -> DeviceProfile | None:
        return self.devices.get(index)

    def with_overrides(self, **changes: Any) -> Settings:
        return replace(self, **changes)


def _resized(tier: Tier, sizes: Mapping[str, int]) -> Tier:
    return Tier(tier.name, max_train_steps=int(sizes.get("max_train_steps", tier.max_train_steps)),
                network_dim=int(sizes.get("network_dim", tier.network_dim)),
                resolution=int(sizes.get("resolution", tier.resolution)))


def _check_tier_minimums(name: str, table: Mapping[str, int]) -> None:
    """A Slurm table by tier: every tier named, each with a whole number above 0."""
    missing = set(TIERS) - set(table)
    bad = sorted(k for k, v in table.items() if not isinstance(v, int) or v < 1)
    if missing or bad:
        raise ConfigError(f"setting {name!r}: every tier needs a whole number above 0 "
                          f"(missing {sorted(missing)}, invalid {bad})")

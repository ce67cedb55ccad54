"""Settings: built-in defaults, then an optional TOML file (`LORA_WORKER_CONFIG`), then `LORA_WORKER_*` env.

Everything an operator may audit about what the worker runs lives here and nowhere else: the tiers, the
SDXL hyperparameters and the device profiles.
"""
from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from lora_worker.config_slurm import (DEFAULT_SLURM_RESOURCES, SlurmResources, parse_slurm_resources,
                                       resources_problem, resources_to_json)
from lora_worker.errors import ConfigError
from lora_worker import binds

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIX = "LORA_WORKER_"
SANDBOXES = ("bwrap", "none")


@dataclass(frozen=True)
class Tier:
    """A training size arbo may ask for; nothing else about the run is the client's to choose."""

    name: str
    max_train_steps: int
    network_dim: int
    resolution: int


TIERS: Mapping[str, Tier] = MappingProxyType(
    {
        "fast": Tier("fast", max_train_steps=400, network_dim=16, resolution=768),
        "balanced": Tier("balanced", max_train_steps=1500, network_dim=32, resolution=768),
        "quality": Tier("quality", max_train_steps=3000, network_dim=32, resolution=1024),
    }
)

# Rendered into argv exactly as written here. network_alpha equals the tier's dim (scale 1.0), as in the
# verified reference run; max_grad_norm is the default a request may lower or raise within bounds.
SDXL_HPARAMS: Mapping[str, str] = MappingProxyType(
    {
        "learning_rate": "1e-4",
        "lr_scheduler": "cosine",
        "optimizer_type": "AdamW8bit",
        "min_snr_gamma": "5",
        "noise_offset": "0.1",
        "max_grad_norm": "1.0",
        "max_data_loader_n_workers": "0",
        # Without it sd-scripts saves the LoRA in float32 (170 MB at dim 16, 341 MB at dim 32); SDXL LoRAs are
        # shared in fp16, half the size, and inference runs in half precision anyway.
        "save_precision": "fp16",
    }
)
# The safetensors dtype each --save_precision writes (sd-scripts casts every saved tensor to it; none, or
# "float", leaves the float32 the LoRA trains in), and so the dtype the artifact verification expects.
SAVE_PRECISION_DTYPES: Mapping[str, str] = MappingProxyType({"float": "F32", "fp16": "F16", "bf16": "BF16"})
# Dispatch records it in each job's row and the supervisor holds the artifact to the recorded value, so a
# change here (with --save_precision) never re-judges an older job.
LORA_DTYPE = SAVE_PRECISION_DTYPES[SDXL_HPARAMS["save_precision"]]

DEFAULT_LORA_TARGETS = "attn_mlp"  # the preset a request that names none gets

# Request-selectable LoRA targets. networks.lora has no include/exclude list, and each --network_args
# token carries exactly one key=value, so each preset maps to at most one token. "{dim}" is the tier's dim.
LORA_TARGET_PRESETS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "attn_mlp": (),  # the default Transformer2DModel targets (attention, projections, feed-forward)
        "attn_mlp_conv": ("conv_dim={dim}",),  # also the 3x3 ResNet convs; sd-scripts sets conv_alpha=1
    }
)


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU the worker may train on, by CUDA index in PCI bus order."""

    index: int
    label: str
    tiers: frozenset[str]
    train_batch_size: int
    vram_mib: Mapping[str, int]  # free VRAM a tier needs before it may start here


DEFAULT_DEVICES: Mapping[int, DeviceProfile] = MappingProxyType(
    {
        # The 24 GB card also hosts the TTS service: lean batch, no quality tier.
        0: DeviceProfile(0, "rtx3090-24g", frozenset({"fast", "balanced"}), 1,
                         MappingProxyType({"fast": 12_000, "balanced": 12_500})),
        1: DeviceProfile(1, "48g", frozenset({"fast", "balanced", "quality"}), 2,
                         MappingProxyType({"fast": 16_000, "balanced": 16_500, "quality": 24_000})),
    }
)

# What `trainer_kind` may say. "simulated" is the test double of sd-scripts (tests/fakes/) that `make demo`
# installs: it trains nothing. It is for a development server only, so it is refused from a config file (the
# deployed settings are one), under systemd, and next to an API token (see `refuse_simulated_when_deployed`).
TRAINER_KINDS = ("sd-scripts", "simulated")
SIMULATED = "simulated"
SIMULATED_ENV = "LORA_WORKER_TRAINER_KIND"

# Free space the output volume needs: the final LoRA (float32, dim 32: ~0.35 GB) plus headroom.
DEFAULT_DISK_MIB: Mapping[str, int] = MappingProxyType({"fast": 1024, "balanced": 2048, "quality": 2048})

# How long each phase may stay silent before the watchdog calls the job stalled. Model loading and caching
# are long and quiet on a cold disk; a training step on either card is seconds.
DEFAULT_STALL_LIMITS_S: Mapping[str, float] = MappingProxyType(
    {
        "launching": 600.0,
        "loading_model": 1200.0,
        "caching_latents": 1800.0,
        "caching_text_encoder_outputs": 900.0,
        "preparing_training": 1200.0,
        "training": 600.0,
        "saving": 600.0,
    }
)


BACKENDS = ("local", "slurm")


# The events a job may send (ledger/outbox.py writes them); `job.checkpoint` once step checkpoints exist.
WEBHOOK_EVENT_TYPES = ("job.queued", "job.started", "job.phase", "job.progress", "job.checkpoint",
                       "job.succeeded", "job.failed", "job.cancelled")


def _slurm_minutes(tier: Tier) -> int:
    """A Slurm time limit for a tier: half an hour for loading, caching and saving, and 6 s per step (the small
    card's slowest step is about 3 s); generous, since TIMEOUT ends a run that might have finished."""
    return 30 + -(-tier.max_train_steps * 6 // 60)


DEFAULT_SLURM_TIME_LIMIT_MIN: Mapping[str, int] = MappingProxyType({n: _slurm_minutes(t) for n, t in TIERS.items()})
# Host memory (not VRAM) a job's cgroup may use: SDXL's checkpoint and text encoders load in RAM first, and the
# 1024 px tier caches larger latents.
DEFAULT_SLURM_MEM_MB: Mapping[str, int] = MappingProxyType({"fast": 24_000, "balanced": 24_000, "quality": 32_000})


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

    def __post_init__(self) -> None:
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
            table = getattr(self, name)
            missing = set(TIERS) - set(table)
            bad = sorted(k for k, v in table.items() if not isinstance(v, int) or v < 1)
            if missing or bad:
                raise ConfigError(f"setting {name!r}: every tier needs a whole number above 0 "
                                  f"(missing {sorted(missing)}, invalid {bad})")

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

    @property
    def device_profiles_apply(self) -> bool:
        """Whether `device_index` picks the card, and with it the batch size, precision and allowed tiers: on
        this host, yes. Under Slurm, no: Slurm picks the GPU among those the tier's `slurm_resources` allow, and
        those resources say the batch size and precision; `device_index` is then accepted and has no effect."""
        return self.backend != "slurm"

    def trainer_profile(self, tier: str, device_index: int) -> tuple[int, str]:
        """(train_batch_size, mixed_precision) of a job: the local card's, or the tier's Slurm resources'."""
        if self.device_profiles_apply:
            return self.devices[device_index].train_batch_size, "bf16"
        res = self.slurm_resources[tier]
        return res.train_batch_size, res.mixed_precision

    def with_overrides(self, **changes: Any) -> Settings:
        return replace(self, **changes)


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Defaults, then the TOML file named by LORA_WORKER_CONFIG, then LORA_WORKER_<FIELD> variables."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_path = environ.get(ENV_PREFIX + "CONFIG")
    if config_path:
        values.update(_read_toml(Path(config_path)))
        if values.get("trainer_kind") == SIMULATED:
            raise ConfigError(f"{config_path}: trainer_kind = \"simulated\" is refused in a config file (the deployed "
                              f"settings are one); a development server sets {SIMULATED_ENV}=simulated instead")
    for f in fields(Settings):
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None and f.name in _ENV_JSON_TABLES:
            values[f.name] = _json_table(f.name, raw)  # LORA_WORKER_SLURM_MEM_MB='{"quality": 48000}'
        elif raw is not None and f.name not in _TABLE_FIELDS:
            values[f.name] = raw
    settings = Settings(**{name: _coerce(name, value) for name, value in values.items()})
    refuse_simulated_when_deployed(settings, environ)
    return settings


def refuse_simulated_when_deployed(settings: Settings, environ: Mapping[str, str]) -> None:
    """A simulated trainer reports LoRAs nobody trained: never under systemd or next to an API token.

    systemd sets INVOCATION_ID for every unit it runs and CREDENTIALS_DIRECTORY where it hands over the token;
    a token file means clients other than this host's developer. Without a token the web app already refuses
    any address but loopback, so a simulated worker is a development server on loopback or nothing."""
    if not settings.simulated:
        return
    deployed = [name for name in ("INVOCATION_ID", "CREDENTIALS_DIRECTORY") if environ.get(name)]
    if settings.api_token_file is not None:
        deployed.append("api_token_file")
    if deployed:
        raise ConfigError("trainer_kind 'simulated' is for a development server only; refused with "
                          + ", ".join(deployed) + " set (a deployed worker runs the real sd-scripts)")


def settings_to_json(settings: Settings) -> str:
    """The settings as JSON, to hand the exact same configuration to a supervisor process."""
    doc: dict[str, Any] = {}
    for f in fields(Settings):
        value = getattr(settings, f.name)
        if f.name == "devices":
            value = {str(i): {"label": d.label, "tiers": sorted(d.tiers), "train_batch_size": d.train_batch_size,
                              "vram_mib": dict(d.vram_mib)} for i, d in value.items()}
        elif f.name == "slurm_resources":
            value = resources_to_json(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, tuple):
            value = [str(v) for v in value]
        elif isinstance(value, Path):
            value = str(value)
        doc[f.name] = value
    return json.dumps(doc)


def settings_from_json(text: str) -> Settings:
    doc = json.loads(text)
    return Settings(**{name: _coerce(name, value) for name, value in doc.items() if value is not None})


_ENV_JSON_TABLES = {"slurm_time_limit_min", "slurm_mem_mb", "slurm_resources"}
_TABLE_FIELDS = {"devices", "disk_mib", "stall_limits_s"} | _ENV_JSON_TABLES
_TIER_TABLE_DEFAULTS: Mapping[str, Mapping[str, int]] = MappingProxyType({
    "disk_mib": DEFAULT_DISK_MIB, "slurm_time_limit_min": DEFAULT_SLURM_TIME_LIMIT_MIN,
    "slurm_mem_mb": DEFAULT_SLURM_MEM_MB})


def _json_table(name: str, raw: str) -> Any:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"setting {name!r}: {ENV_PREFIX}{name.upper()} is not a JSON object: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"setting {name!r}: {ENV_PREFIX}{name.upper()} is not a JSON object")
    return value
_FIELD_TYPES = {f.name: str(f.type) for f in fields(Settings)}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    unknown = set(data) - set(_FIELD_TYPES)
    if unknown:
        # A typo in an operator's file must stop the service, not be ignored.
        raise ConfigError(f"unknown setting(s) in {path}: {', '.join(sorted(unknown))}")
    return data


def _coerce(name: str, value: Any) -> Any:
    kind = _FIELD_TYPES[name]
    try:
        if name in _PARSERS:
            return _PARSERS[name](value)
        if name in ("stall_limits_s", *_TIER_TABLE_DEFAULTS):
            default = _TIER_TABLE_DEFAULTS.get(name, DEFAULT_STALL_LIMITS_S)
            unknown = set(map(str, dict(value))) - set(default)
            if unknown:  # `trainig = 60` would otherwise leave the real limit at its default, silently
                raise KeyError(f"unknown key(s) {sorted(unknown)}; known: {sorted(default)}")
            return MappingProxyType({**default, **{str(k): float(v) if name == "stall_limits_s" else int(v)
                                                   for k, v in dict(value).items()}})
        if name == "model_dirs":
            items = value.split(os.pathsep) if isinstance(value, str) else list(value)
            return tuple(Path(p) for p in items if p)
        if kind.startswith("Path"):
            return Path(value) if value not in ("", None) else None
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            return _bool(value)
        return str(value)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"setting {name!r}: {exc}") from exc


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


DEVICE_KEYS = frozenset({"label", "tiers", "train_batch_size", "vram_mib"})


def _devices(table: Mapping[str, Any]) -> Mapping[int, DeviceProfile]:
    profiles = {}
    for key, spec in dict(table).items():
        index = int(key)
        unknown_keys = set(dict(spec)) - DEVICE_KEYS
        if unknown_keys:  # `vram = …` for `vram_mib` would otherwise leave the card without its limits
            raise ValueError(f"device {index}: unknown key(s) {sorted(unknown_keys)}; known: {sorted(DEVICE_KEYS)}")
        tiers = frozenset(spec["tiers"])
        unknown = tiers - set(TIERS)
        if unknown:
            raise ValueError(f"device {index}: unknown tier(s) {sorted(unknown)}")
        vram = {str(k): int(v) for k, v in dict(spec.get("vram_mib", {})).items()}
        stray = set(vram) - set(TIERS)
        if stray:
            raise ValueError(f"device {index}: vram_mib names unknown tier(s) {sorted(stray)}")
        missing = tiers - set(vram)
        if missing:
            raise ValueError(f"device {index}: vram_mib missing for {sorted(missing)}")
        profiles[index] = DeviceProfile(index, str(spec["label"]), tiers, int(spec["train_batch_size"]),
                                        MappingProxyType(vram))
    return MappingProxyType(profiles)


_PARSERS = {"devices": _devices, "slurm_resources": parse_slurm_resources}

__all__ = ["Settings", "Tier", "DeviceProfile", "TIERS", "SDXL_HPARAMS", "LORA_TARGET_PRESETS",
           "DEFAULT_LORA_TARGETS", "SAVE_PRECISION_DTYPES", "LORA_DTYPE", "DEFAULT_DEVICES", "TRAINER_KINDS",
           "SlurmResources",
           "SIMULATED", "BACKENDS", "load_settings", "refuse_simulated_when_deployed",
           "settings_to_json", "settings_from_json"]

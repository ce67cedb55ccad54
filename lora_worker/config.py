"""Settings: built-in defaults (lora_worker/config_settings.py), then an optional TOML file
(`LORA_WORKER_CONFIG`), then `LORA_WORKER_*` env; and the JSON that hands the same settings to a supervisor.

Everything an operator may audit about what the worker runs lives in the config modules and nowhere else: the
tiers, the SDXL hyperparameters and the device profiles (config_tables.py), the Slurm resources
(config_slurm.py). The names other modules use are re-exported here, so that `lora_worker.config` stays the one
place to import them from.
"""
from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lora_worker.config_settings import REPO_ROOT, Settings
from lora_worker.config_slurm import SlurmResources, parse_slurm_resources, resources_to_json
from lora_worker.config_tables import (
    BACKENDS,
    DEFAULT_DEVICES,
    DEFAULT_DISK_MIB,
    DEFAULT_LORA_TARGETS,
    DEFAULT_SLURM_MEM_MB,
    DEFAULT_SLURM_TIME_LIMIT_MIN,
    DEFAULT_STALL_LIMITS_S,
    LORA_DTYPE,
    LORA_TARGET_PRESETS,
    SAVE_PRECISION_DTYPES,
    SDXL_HPARAMS,
    SIMULATED,
    SIMULATED_ENV,
    TIERS,
    TRAINER_KINDS,
    WEBHOOK_EVENT_TYPES,
    DeviceProfile,
    Tier,
    TrainerProfile,
)
from lora_worker.errors import ConfigError

ENV_PREFIX = "LORA_WORKER_"


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Defaults, then the TOML file named by LORA_WORKER_CONFIG, then LORA_WORKER_<FIELD> variables."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_path = environ.get(ENV_PREFIX + "CONFIG")
    if config_path:
        values.update(_read_toml(Path(config_path)))
        if "rig_tier_sizes" in values:
            raise ConfigError(f"{config_path}: rig_tier_sizes is for the real trainer's CPU rig in tests only; "
                              "refused in a config file (the deployed settings are one)")
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
# Never read from the environment: rig_tier_sizes is test-only (config_settings.py).
_TABLE_FIELDS = {"devices", "disk_mib", "stall_limits_s", "rig_tier_sizes"} | _ENV_JSON_TABLES
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
            return _tier_table(name, value)
        if name == "model_dirs":
            items = value.split(os.pathsep) if isinstance(value, str) else list(value)
            return tuple(Path(p) for p in items if p)
        return _scalar(kind, value)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"setting {name!r}: {exc}") from exc


def _tier_table(name: str, value: Any) -> Mapping[str, Any]:
    """A table by tier (or phase): the defaults, each key the value names replaced."""
    default = _TIER_TABLE_DEFAULTS.get(name, DEFAULT_STALL_LIMITS_S)
    unknown = set(map(str, dict(value))) - set(default)
    if unknown:  # `trainig = 60` would otherwise leave the real limit at its default, silently
        raise KeyError(f"unknown key(s) {sorted(unknown)}; known: {sorted(default)}")
    return MappingProxyType({**default, **{str(k): float(v) if name == "stall_limits_s" else int(v)
                                           for k, v in dict(value).items()}})


def _scalar(kind: str, value: Any) -> Any:
    """One value of a field's annotated type (`Path | None`, int, float, bool, str)."""
    if kind.startswith("Path"):
        return Path(value) if value not in ("", None) else None
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return _bool(value)
    return str(value)


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


def _rig_tier_sizes(table: Mapping[str, Any]) -> Mapping[str, Mapping[str, int]]:
    return {str(tier): {str(k): int(v) for k, v in dict(sizes).items()} for tier, sizes in dict(table).items()}


_PARSERS = {"devices": _devices, "slurm_resources": parse_slurm_resources, "rig_tier_sizes": _rig_tier_sizes}

__all__ = ["Settings", "Tier", "DeviceProfile", "TrainerProfile", "TIERS", "SDXL_HPARAMS", "LORA_TARGET_PRESETS",
           "DEFAULT_LORA_TARGETS", "SAVE_PRECISION_DTYPES", "LORA_DTYPE", "DEFAULT_DEVICES", "DEFAULT_STALL_LIMITS_S",
           "TRAINER_KINDS", "SlurmResources", "SIMULATED", "SIMULATED_ENV", "BACKENDS", "WEBHOOK_EVENT_TYPES",
           "REPO_ROOT", "ENV_PREFIX", "ConfigError", "load_settings", "refuse_simulated_when_deployed",
           "settings_to_json", "settings_from_json"]

"""The Slurm part of the settings: what each tier's job asks the cluster for (config.py's `slurm_resources`).

Under Slurm these take the place of the local device profile (config.DeviceProfile): the GPU is Slurm's choice
among those `gres` and `constraint` allow, so the batch size and precision must fit every GPU they allow, not
the card `device_index` names on the worker's host. Pure data and checks; no import of the project.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

TIER_NAMES = ("fast", "balanced", "quality")  # config.TIERS' keys (a test holds them equal)
MIXED_PRECISIONS = ("bf16", "fp16")  # bf16 needs an Ampere or later GPU; fp16 runs on older ones
GRES_ONE_GPU = re.compile(r"gpu(:[A-Za-z0-9_.-]+)?:1")  # one GPU, of any type or of the one named


@dataclass(frozen=True)
class SlurmResources:
    """What a tier's job asks Slurm for, and what the trainer is told about that GPU."""

    gres: str = "gpu:1"  # `--gres`: `gpu:1`, or `gpu:<type>:1` for a GPU type the cluster's gres.conf names
    constraint: str = ""  # `--constraint` (node features), none when empty
    train_batch_size: int = 1
    mixed_precision: str = "bf16"


DEFAULT_SLURM_RESOURCES: Mapping[str, SlurmResources] = MappingProxyType({n: SlurmResources() for n in TIER_NAMES})
SLURM_RESOURCE_KEYS = frozenset(f.name for f in fields(SlurmResources))


def parse_slurm_resources(table: Mapping[str, Any]) -> Mapping[str, SlurmResources]:
    chosen = dict(DEFAULT_SLURM_RESOURCES)
    for tier, spec in dict(table).items():
        if tier not in TIER_NAMES:
            raise KeyError(f"unknown tier {tier!r}; known: {sorted(TIER_NAMES)}")
        if isinstance(spec, SlurmResources):
            chosen[tier] = spec
            continue
        unknown = set(dict(spec)) - SLURM_RESOURCE_KEYS
        if unknown:
            raise KeyError(f"tier {tier!r}: unknown key(s) {sorted(unknown)}; known: {sorted(SLURM_RESOURCE_KEYS)}")
        spec = dict(spec)
        if "train_batch_size" in spec:
            spec["train_batch_size"] = int(spec["train_batch_size"])
        chosen[tier] = SlurmResources(**spec)
    return MappingProxyType(chosen)


def resources_to_json(table: Mapping[str, SlurmResources]) -> dict[str, dict[str, Any]]:
    return {tier: {k: getattr(res, k) for k in sorted(SLURM_RESOURCE_KEYS)} for tier, res in table.items()}


def resources_problem(table: Mapping[str, SlurmResources]) -> str | None:
    """Why Slurm or the trainer could not take a tier's resources (a sentence), or None."""
    missing = sorted(set(TIER_NAMES) - set(table))
    if missing:
        return f"no resources for tier(s) {missing}"
    for tier, res in table.items():
        if problem := tier_problem(res):
            return f"tier {tier!r}: {problem}"
    return None


def tier_problem(res: SlurmResources) -> str | None:
    if not GRES_ONE_GPU.fullmatch(res.gres):
        return f"gres {res.gres!r} is not `gpu:1` or `gpu:<type>:1` (one GPU: the trainer runs one process)"
    if any(c.isspace() or not c.isprintable() for c in res.constraint):
        return f"constraint {res.constraint!r} holds a space or a control character"
    if not isinstance(res.train_batch_size, int) or not 1 <= res.train_batch_size <= 64:
        return f"train_batch_size {res.train_batch_size!r} is not a whole number from 1 to 64"
    if res.mixed_precision not in MIXED_PRECISIONS:
        return f"mixed_precision {res.mixed_precision!r} is not one of {', '.join(MIXED_PRECISIONS)}"
    return None

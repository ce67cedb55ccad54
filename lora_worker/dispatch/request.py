"""A training request twice: as the client sent it (`TrainRequest`), and as dispatch accepted it
(`ResolvedRequest`: real paths, the train id, the tier, and the LoRA the run must produce).

`resolve_request` is the one place a tier is looked up by name and the one place the LoRA's path is built.
Everything downstream (argv, the row, the artifact check) reads the resolved request or the row made from it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_worker.config import LORA_DTYPE, TIERS, Settings, Tier
from lora_worker.dispatch.samples import SamplePrompt, as_rows, resolve_samples
from lora_worker.errors import InvalidRequest
from lora_worker.host import kohya
from lora_worker.host.safetensors import ExpectedLora
from lora_worker.ledger.outbox import Subscription


@dataclass(frozen=True)
class TrainRequest:
    """What arbo asked for, as the schema loaded it: paths as given (not yet trusted), the tier by name."""

    dataset_dir: str
    base_model_path: str
    output_dir: str
    output_name: str
    trigger: str
    subject_class: str
    repeats: int
    tier: str
    device_index: int
    seed: int
    max_grad_norm: float | None = None
    lora_target_modules: str | None = None
    # The webhook events this job sends: None, the configured ones; (), none (an opt-out). Never a URL: where
    # events go is the configuration's alone.
    webhook_events: tuple[str, ...] | None = None
    # The sample prompts, each {"prompt", "seed"?}: None, one of the trigger and class; (), no samples.
    samples: tuple[dict[str, Any], ...] | None = None


def webhook_subscription(settings: Settings, request: TrainRequest) -> str | None:
    """The job's webhook subscription as its row records it (ledger/outbox.py `Subscription`), or None: no
    target configured, or the request opted out. A request only narrows the configured types."""
    if not settings.webhook_url:
        return None
    chosen = settings.webhook_types if request.webhook_events is None else request.webhook_events
    types = frozenset(chosen) & frozenset(settings.webhook_types)
    if not types:
        return None
    return Subscription(types, settings.webhook_progress_interval_s, settings.webhook_give_up_s).to_json()


@dataclass(frozen=True)
class ResolvedRequest:
    """A request whose paths are the contained real paths the trainer receives. Built by `resolve_request`."""

    train_id: str
    dataset_dir: Path
    base_model_path: Path
    output_dir: Path
    output_name: str
    trigger: str
    subject_class: str
    repeats: int
    tier: Tier
    device_index: int
    seed: int
    max_grad_norm: float | None
    lora_target_modules: str | None
    lora_file: Path  # <output_dir>/<output_name>.safetensors: where sd-scripts saves the final LoRA
    expected: ExpectedLora  # what that file must be for the job to succeed
    samples: tuple[SamplePrompt, ...] = ()  # each with its seed; () draws none

    @property
    def kohya_folder(self) -> str:
        """The dataset sub-folder sd-scripts reads repeats and class tokens from: `10_ohwx woman`."""
        return kohya.folder_name(self.repeats, self.trigger, self.subject_class)

    def row_columns(self) -> dict[str, Any]:
        """The request as the job row records it (models.Job says which column means what)."""
        return {
            "train_id": self.train_id, "dataset_dir": str(self.dataset_dir),
            "base_model_path": str(self.base_model_path), "output_dir": str(self.output_dir),
            "output_name": self.output_name, "trigger": self.trigger, "subject_class": self.subject_class,
            "repeats": self.repeats, "tier": self.tier.name, "device_index": self.device_index, "seed": self.seed,
            "max_grad_norm": self.max_grad_norm, "lora_target_modules": self.lora_target_modules,
            "total_steps": self.expected.steps, "lora_file": str(self.lora_file), "lora_rank": self.expected.rank,
            "lora_steps": self.expected.steps, "lora_dtype": self.expected.dtype,
            "sample_prompts": as_rows(self.samples),
        }


def resolve_request(request: TrainRequest, *, train_id: str, dataset_dir: Path, base_model_path: Path,
                    output_dir: Path, tiers: Mapping[str, Tier] = TIERS) -> ResolvedRequest:
    """Bind a request to the paths dispatch resolved and contained, its tier (of `tiers`: Settings.tiers), and
    the LoRA it must produce."""
    tier = tiers.get(request.tier)
    if tier is None:
        raise InvalidRequest({"tier": [f"Unknown tier {request.tier!r}; known: {', '.join(TIERS)}."]})
    expected = ExpectedLora(rank=tier.network_dim, output_name=request.output_name, steps=tier.max_train_steps,
                            seed=request.seed, dtype=LORA_DTYPE)
    return ResolvedRequest(
        train_id=train_id, dataset_dir=dataset_dir, base_model_path=base_model_path, output_dir=output_dir,
        output_name=request.output_name, trigger=request.trigger, subject_class=request.subject_class,
        repeats=request.repeats, tier=tier, device_index=request.device_index, seed=request.seed,
        max_grad_norm=request.max_grad_norm, lora_target_modules=request.lora_target_modules,
        lora_file=output_dir / f"{request.output_name}.safetensors", expected=expected,
        samples=resolve_samples(request.samples, request.trigger, request.subject_class))


def check_device(tier: str, device_index: int, settings: Settings) -> None:
    """The device must be configured and allow the tier; never a silent move to another card or tier."""
    device = settings.device(device_index)
    if device is None:
        known = ", ".join(str(i) for i in sorted(settings.devices)) or "none"
        raise InvalidRequest({"device_index": [f"No device {device_index} is configured (configured: {known})."]})
    if tier not in device.tiers:
        allowed = ", ".join(t for t in TIERS if t in device.tiers)
        raise InvalidRequest({"tier": [f"Tier {tier!r} is not allowed on device {device_index} "
                                       f"({device.label}); allowed there: {allowed}."]})

"""TrainRequest: a validated, resolved training request. Nothing downstream re-reads the raw JSON."""
from __future__ import annotations

import os
from dataclasses import dataclass

from lora_worker.config import TIERS, Settings
from lora_worker.errors import InvalidRequest


@dataclass(frozen=True)
class TrainRequest:
    """What arbo asked for. Built from the JSON with the paths as given; `Worker.resolve` replaces them by the
    resolved, contained real paths and fills in `train_id` before anything else reads them."""

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
    train_id: str = ""
    max_grad_norm: float | None = None
    lora_target_modules: str | None = None

    @property
    def kohya_folder(self) -> str:
        """The dataset sub-folder sd-scripts reads repeats and class tokens from: `10_ohwx woman`."""
        return f"{self.repeats}_{self.trigger} {self.subject_class}"

    @property
    def lora_file(self) -> str:
        return os.path.join(self.output_dir, f"{self.output_name}.safetensors")


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

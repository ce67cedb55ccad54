"""The job row `transcript.checkpoints.Checkpoints` watches, as the supervisor and the Slurm poller read it: only
the columns it needs (where the saves land, what a step LoRA must be)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WatchedJob:
    output_dir: str
    output_name: str = "ohwx"
    lora_rank: int = 4
    lora_steps: int = 9
    seed: int = 42
    lora_dtype: str = "F16"
    output_dev_ino: str | None = None

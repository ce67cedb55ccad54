"""Free space on the output volume, so a run never trains for an hour and then fails to save."""
from __future__ import annotations

import shutil
from pathlib import Path

from lora_worker.config_tables import STATE_MIB, STATES_KEPT, STEP_LORA_MIB, STEP_LORAS_KEPT
from lora_worker.errors import InsufficientDisk


SAMPLE_IMAGE_MIB = 2  # a sample PNG at 1024 px: ~1.5 MB (the rig's 256 px ones are ~100 KB)


def checkpoint_mib(network_dim: int, step_loras: int = STEP_LORAS_KEPT, images: int = 0) -> int:
    """What the step checkpoints hold at their peak. sd-scripts writes a new step LoRA and state before it removes
    the old ones (train_network.py: save_model, then save_and_remove_state_stepwise, then remove_model), so each
    kind has one more than it keeps while a save runs; at the end it writes the end state `<name>-state/` beside
    the kept step state (and then the final LoRA, which `disk_mib` counts), again one state more than kept.
    `step_loras`: how many step LoRAs the job keeps (every sampled one, dispatch/samples.py); `images`: the sample
    images it draws."""
    known = network_dim if network_dim in STATE_MIB else max(STATE_MIB)  # a rig's tiny rank: an over-estimate
    return ((STATES_KEPT + 1) * STATE_MIB[known] + (step_loras + 1) * STEP_LORA_MIB[known]
            + images * SAMPLE_IMAGE_MIB)


def required_mib(disk_mib: int, network_dim: int, step_loras: int = STEP_LORAS_KEPT, images: int = 0, *,
                 resuming: bool = False) -> int:
    """The tier's `disk_mib` (the final LoRA and headroom), its checkpoints at their peak and its sample images. A
    resume's run finds the state it resumes from and its step LoRA on disk already (kept by the run it continues,
    removed by its own first save): they are counted once, as what is kept, not again as what it will write."""
    known = network_dim if network_dim in STATE_MIB else max(STATE_MIB)
    there = STATE_MIB[known] + STEP_LORA_MIB[known] if resuming else 0
    return disk_mib + checkpoint_mib(network_dim, step_loras, images) - there


def require_free_space(path: Path, need_mib: int) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    free_mib = shutil.disk_usage(probe).free // (1024 * 1024)
    if free_mib < need_mib:
        raise InsufficientDisk(
            f"The output volume has {free_mib} MiB free; this tier needs {need_mib} MiB.",
            free_mib=free_mib, need_mib=need_mib, path=str(probe))

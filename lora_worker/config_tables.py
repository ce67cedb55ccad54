"""What the worker trains and on what, as an operator audits it: the tiers, the SDXL hyperparameters, the LoRA
target presets, the device profiles, and the defaults of the per-tier settings (lora_worker/config_settings.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple


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


class TrainerProfile(NamedTuple):
    """What the trainer is told of the GPU a job gets: its batch size and precision (a backend's `profile`)."""

    train_batch_size: int
    mixed_precision: str


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

# Free space the output volume needs beyond the step checkpoints: the final LoRA (float32, dim 32: ~0.35 GB) plus
# headroom. The preflight adds what the checkpoints take at their peak (dispatch/disk.py `checkpoint_mib`).
DEFAULT_DISK_MIB: Mapping[str, int] = MappingProxyType({"fast": 1024, "balanced": 2048, "quality": 2048})

# Step checkpoints, always on: every SAVE_EVERY_N_STEPS[tier] optimizer steps sd-scripts writes a step LoRA
# `<name>-step%08d.safetensors` and a state `<name>-step%08d-state/` (--save_state), the state a crashed run
# resumes from. About one every 2 (fast) to 20 (quality) minutes of training on the cards, a few seconds each.
# Each divides its tier's steps (issue 33): sample images are drawn where a step LoRA is saved (the same
# interval, so each pass is tied to a verified step LoRA), and only an interval that divides the steps samples
# the final weights (with step sampling sd-scripts skips its pass at the end, train_util.py L6390). The save at
# the last step writes those weights once more (a step LoRA beside the final LoRA, a state beside the end state):
# the price of samples of the final LoRA, measured on the rig (docs/samples.md).
SAVE_EVERY_N_STEPS: Mapping[str, int] = MappingProxyType({"fast": 100, "balanced": 300, "quality": 500})
# How many of each the trainer keeps (the rest it removes, `removing old …`). One state: the newest is the one a
# resume wants, and sd-scripts removes the older only once the newer is written, so a crash mid-save still leaves
# a whole one. One step LoRA for a job without samples: it is the crash's usable result. With samples, every
# sampled step LoRA up to SAMPLED_STEP_LORAS_KEPT: they are what a client compares and may promote (POST
# /train/<id>/promote); each kept costs 85-170 MB, counted by the disk preflight.
STATES_KEPT = 1
STEP_LORAS_KEPT = 1
SAMPLED_STEP_LORAS_KEPT = 8
# On disk, per network_dim (MiB, rounded up): a state in AdamW8bit (model.safetensors in float32, optimizer.bin,
# the scheduler and RNG states) and a step LoRA in --save_precision fp16.
STATE_MIB: Mapping[int, int] = MappingProxyType({16: 257, 32: 513})
STEP_LORA_MIB: Mapping[int, int] = MappingProxyType({16: 85, 32: 170})

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
        # A pass draws each prompt's sampler steps (its bar moves: output is life), then decodes with the VAE.
        "sampling": 900.0,
        "saving": 600.0,
    }
)


# Where a job may run (backends.py). Only the settings' own checks (config_settings.py) and the backends themselves
# compare a name with these: everything else asks the row's backend (backends.backend_of) what differs.
BACKENDS = ("local", "slurm")


# The events a job may send (ledger/outbox.py writes them; `job.checkpoint` with its checkpoints row, `job.sample`
# with a sample pass's images, `job.promoted` when a step LoRA becomes the result).
WEBHOOK_EVENT_TYPES = ("job.queued", "job.started", "job.phase", "job.progress", "job.checkpoint", "job.sample",
                       "job.succeeded", "job.failed", "job.cancelled", "job.promoted")

# Sample images (issue 33, docs/samples.md): drawn by sd-scripts before the first step (the base model's look)
# and at each step save, from the job's prompts at its tier's resolution. The sampler goes on the command line
# (--sample_sampler: argparse refuses a name outside its choices, where a name in the prompts file falls back to
# DDIM silently, so the file names none); steps, CFG scale and the negative prompt go in the file. A request's
# prompt without a seed gets SAMPLE_SEED + its index: fixed, so the steps of a job compare.
SAMPLE_SAMPLER = "euler_a"
SAMPLE_STEPS = 20
SAMPLE_SCALE = 7.0
SAMPLE_NEGATIVE_PROMPT = "lowres, blurry, jpeg artifacts, watermark, text"
SAMPLE_SEED = 42
MAX_SAMPLE_PROMPTS = 4
MAX_SAMPLE_PROMPT_CHARS = 300


def tier_minutes_at_most(tier: Tier) -> int:
    """A bound of a tier's wall time, the default Slurm time limit: half an hour for loading, caching and saving,
    and 6 s per step (the small card's slowest step is about 3 s); generous, since TIMEOUT ends a run that might
    have finished. A dry run without history says it as an upper bound, never as a forecast."""
    return 30 + -(-tier.max_train_steps * 6 // 60)


DEFAULT_SLURM_TIME_LIMIT_MIN: Mapping[str, int] = MappingProxyType(
    {n: tier_minutes_at_most(t) for n, t in TIERS.items()})
# Host memory (not VRAM) a job's cgroup may use: SDXL's checkpoint and text encoders load in RAM first, and the
# 1024 px tier caches larger latents.
DEFAULT_SLURM_MEM_MB: Mapping[str, int] = MappingProxyType({"fast": 24_000, "balanced": 24_000, "quality": 32_000})

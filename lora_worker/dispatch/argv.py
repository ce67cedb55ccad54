"""The one command the worker runs, built by pure functions from a ResolvedRequest and the audited constants.

Shape: `<venv>/accelerate launch <pinned launcher flags> <abs sdxl_train_network.py> <script args>`, where
every script arg is either a constant `--flag` or one `--key=value` token with a key from SCRIPT_KEYS, and, for a
job with samples, the switch SAMPLE_FLAGS (dispatch/samples.py: the one place the sample flags come from).
A value can never become a flag of its own (`--config_file=…` would replace the whole configuration), and
no key ever comes from the request. `shlex.join` is for display only; nothing here goes through a shell.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lora_worker.config import LORA_TARGET_PRESETS, SDXL_HPARAMS, Settings
from lora_worker.config_tables import STATES_KEPT
from lora_worker.dispatch.request import ResolvedRequest
from lora_worker.dispatch.samples import SAMPLE_FLAGS, prompts_file, sample_args, sample_switches, step_loras_kept
from lora_worker.host.trainer import ENV_KEYS, trainer_env

if TYPE_CHECKING:
    from lora_worker.backends import Backend
    from lora_worker.dispatch.presentation import DatasetConfig

__all__ = ["ENV_KEYS", "SAMPLE_FLAGS", "SCRIPT_FLAGS", "SCRIPT_KEYS", "build_argv", "build_env", "keep_last",
           "launcher_argv", "script_args", "trainer_env"]

# Constant switches of the lean SDXL recipe: U-Net only, latents and text-encoder outputs cached in memory
# (the TE cache requires --network_train_unet_only), gradient checkpointing, SDPA attention, and logs as
# plain lines on stdout (--console_log_simple) so the parser sees one record per line. --save_state: a state
# beside each step LoRA (and one at the end), so a run that dies can be resumed.
SCRIPT_FLAGS: tuple[str, ...] = (
    "--network_train_unet_only",
    "--cache_latents",
    "--cache_text_encoder_outputs",
    "--gradient_checkpointing",
    "--sdpa",
    "--enable_bucket",
    "--bucket_no_upscale",
    "--console_log_simple",
    "--save_state",
)

# Every key a `--key=value` token may carry, in the order they are emitted.
SCRIPT_KEYS: tuple[str, ...] = (
    "pretrained_model_name_or_path",
    "tokenizer_cache_dir",
    "dataset_config",  # the dataset as the worker presents it (dispatch/presentation.py): one epoch covers the run
    "train_data_dir",  # rows accepted before that: the kohya folder's own repeats (only their resumes rebuild it)
    "output_dir",
    "output_name",
    "save_model_as",
    "save_precision",
    "caption_extension",
    "resolution",
    "network_module",
    "network_dim",
    "network_alpha",
    "network_args",
    "mixed_precision",
    "learning_rate",
    "lr_scheduler",
    "optimizer_type",
    "min_snr_gamma",
    "noise_offset",
    "max_grad_norm",
    "max_train_steps",
    "save_every_n_steps",
    "save_last_n_steps",
    "save_last_n_steps_state",
    "train_batch_size",
    "max_data_loader_n_workers",
    "seed",
    "sample_prompts",
    "sample_every_n_steps",
    "sample_sampler",
)


def launcher_argv(settings: Settings, mixed_precision: str = "bf16") -> list[str]:
    # Every launcher setting pinned on the command line: a stray accelerate config could otherwise turn on
    # multi-GPU, DeepSpeed or gpu_ids (which overrides CUDA_VISIBLE_DEVICES).
    return [
        str(settings.accelerate), "launch",
        "--num_processes=1",
        "--num_machines=1",
        f"--mixed_precision={mixed_precision}",
        "--dynamo_backend=no",
        f"--num_cpu_threads_per_process={settings.cpu_threads}",
        str(settings.train_script),
    ]


def script_args(req: ResolvedRequest, settings: Settings, backend: Backend,
                config: DatasetConfig | None) -> list[tuple[str, str]]:
    """The `--key=value` pairs, in SCRIPT_KEYS order. Paths become text here, and only here. The dataset is the
    `config` sd-scripts reads it through (`--dataset_config`); None only rebuilds a row accepted before there was
    one (`--train_data_dir`: sd-scripts reads the folder's own repeats)."""
    # Rank and steps come from the expected LoRA, so what the trainer is told is what its file is held to.
    lora = req.expected
    batch_size, mixed_precision = backend.profile(settings, req.tier.name, req.device_index)
    max_grad_norm = repr(float(req.max_grad_norm)) if req.max_grad_norm is not None \
        else SDXL_HPARAMS["max_grad_norm"]
    every = settings.save_every_n_steps(req.tier.name)  # the step saves and the sample passes (docs/samples.md)
    values: dict[str, str | None] = {
        "pretrained_model_name_or_path": str(req.base_model_path),
        "tokenizer_cache_dir": str(settings.tokenizer_cache_dir),
        "dataset_config": str(config.path) if config is not None else None,
        "train_data_dir": str(req.dataset_dir) if config is None else None,
        "output_dir": str(req.output_dir),
        "output_name": req.output_name,
        "save_model_as": "safetensors",
        "save_precision": SDXL_HPARAMS["save_precision"],
        "caption_extension": ".txt",  # sd-scripts' default is .caption
        "resolution": str(req.tier.resolution),
        "network_module": "networks.lora",
        "network_dim": str(lora.rank),
        "network_alpha": str(lora.rank),
        "network_args": _network_arg(req, lora.rank),
        "mixed_precision": mixed_precision,  # the script's own flag wins over the launcher's
        "learning_rate": SDXL_HPARAMS["learning_rate"],
        "lr_scheduler": SDXL_HPARAMS["lr_scheduler"],
        "optimizer_type": SDXL_HPARAMS["optimizer_type"],
        "min_snr_gamma": SDXL_HPARAMS["min_snr_gamma"],
        "noise_offset": SDXL_HPARAMS["noise_offset"],
        "max_grad_norm": max_grad_norm,
        "max_train_steps": str(lora.steps),
        "save_every_n_steps": str(every),
        "save_last_n_steps": str(keep_last(step_loras_kept(req.samples, lora.steps, every), every)),
        "save_last_n_steps_state": str(keep_last(STATES_KEPT, every)),
        "train_batch_size": str(batch_size),
        "max_data_loader_n_workers": SDXL_HPARAMS["max_data_loader_n_workers"],
        "seed": str(req.seed),
        **sample_args(prompts_file(req.samples, req.tier, settings, backend), every),
    }
    return [(key, value) for key in SCRIPT_KEYS if (value := values[key]) is not None]


def keep_last(kept: int, every: int) -> int:
    """The --save_last_n_steps(_state) value that keeps exactly the newest `kept` saves of every `every` steps.

    The value is a number of steps, not of files: at a save at step s, sd-scripts (train_util
    get_remove_step_no, save_and_remove_state_stepwise) removes the save at r = s - value - 1, rounded down to
    a multiple of `every`. Removing s - kept * every (the save before the kept ones) takes a value in
    [(kept - 1) * every, kept * every - 1]; (kept - 1) * every + 1 is in it for every >= 2, and never 0 (which
    --save_last_n_steps_state reads as unset, falling back to --save_last_n_steps).
    """
    if kept < 1 or every < 2:
        raise ValueError(f"cannot keep {kept} saves of every {every} steps")
    return (kept - 1) * every + 1


def build_argv(req: ResolvedRequest, settings: Settings, backend: Backend, config: DatasetConfig | None) -> list[str]:
    """The complete argv, stored in the job row and executed verbatim by the supervisor (or the node). The batch
    size and precision are the row's backend's `profile`: the card's on this host, the tier's under Slurm; the
    dataset is `config` (dispatch/presentation.py `config_for`, its path names its content)."""
    pairs = [f"--{key}={value}" for key, value in script_args(req, settings, backend, config)]
    _, mixed_precision = backend.profile(settings, req.tier.name, req.device_index)
    switches = sample_switches(prompts_file(req.samples, req.tier, settings, backend))
    return [*launcher_argv(settings, mixed_precision), *pairs, *SCRIPT_FLAGS, *switches]


def build_env(req: ResolvedRequest, settings: Settings, backend: Backend) -> dict[str, str]:
    """The trainer's whole environment (host/trainer.py `trainer_env`, an allow-list), with the card the row's
    backend names: the request's on this host; none under Slurm, whose node sets the one it allocated."""
    return trainer_env(settings, backend.visible_devices(req.device_index))


def _network_arg(req: ResolvedRequest, dim: int) -> str | None:
    preset = LORA_TARGET_PRESETS[req.lora_target_modules or "attn_mlp"]
    return preset[0].format(dim=dim) if preset else None

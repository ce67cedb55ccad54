"""Test double of kohya-ss sd-scripts `sdxl_train_network.py` (main @ 48d368fa), for runs without torch or a GPU.

It behaves as docs/reference/sd-scripts.md and sd-scripts-failures.md document, and prints what the
captures in tests/data/*.jsonl show (with --save_state and --resume, what the rig's runs in tests/data/rig show and
docs/reference/sd-scripts-resume.md documents: sd_states.py, held to them by tests/test_fake_rig.py):
- argparse with the real flag names and defaults: an unknown flag exits 2 with `error: unrecognized arguments`;
- the dataset scan of `<train_data_dir>/<n>_<name>/` (non-recursive, `--caption_extension`, default
  `.caption`): no images → `No data found. …` and exit 0 with no file; a 0-byte caption → AssertionError;
- with --console_log_simple, log lines as plain lines on stdout, in the order of the real transcript; the
  `print` lines (`epoch N/M`, `saving checkpoint: …`) on stdout too;
- tqdm bars on stderr, drawn by tqdm itself: `steps` with `avr_loss`, two redraws per step (update, then
  set_postfix), closed after `model saved.`;
- a missing model file → the diffusers ValueError; a checkpoint that lacks tensors (or has others) → the
  loader's `RuntimeError: Error(s) in loading state_dict for SdxlUNet2DConditionModel:` with its `Missing
  key(s)` list, exit 1 while loading (fail_model_missing_keys.log); the expected keys are the real
  checkpoint's header (tests/data/sdxl-checkpoint-header.json, copied next to this script);
- tokenizers as transformers loads them from --tokenizer_cache_dir: none → the TypeError seen offline; no
  tokenizer_config.json → model_max_length 10^30 → `OverflowError: cannot fit 'int' into an index-sized
  integer` while caching text-encoder outputs, exit 1 (fail_tokenizer_hollow.log);
- a real `.safetensors` LoRA: the 722 U-Net modules of the real run's LoRA (its header,
  tests/data/lora-header-run1_simple.json, copied next to this script), shapes for the requested rank, that
  run's `ss_*` metadata with this run's values; tensor data left sparse (zeros) so it is cheap; every
  tensor in the `--save_precision` dtype (none or float → F32, fp16 → F16, bf16 → BF16), as save_weights casts;
- the functions on a failure's traceback named as sd-scripts names them (`read_caption`, `load_target_model`,
  `_load_tokenizer`, `_get_input_ids`), since the worker classes a failure by its frames;
- no signal handling of its own (SIGTERM kills it; SIGINT raises KeyboardInterrupt), like the real trainer.

Behaviour for a test is read from `fake_trainer.json` in the working directory (the sd-scripts dir), because
the worker gives the trainer an allow-listed environment and nothing else:
  step_s, load_s, cache_s, sha_s, teardown_s     sleeps that stand in for the real phases
  load_mb                                         host memory taken while loading the model (a --mem limit's test)
  oom_at_step, crash_at_step, nan_from_step      failures at a step
  hang_in                                         sleep forever at the start of a phase (see PHASES)
  ignore_sigterm                                  the trainer ignores SIGTERM
  grandchild                                      "group" or "session": fork a sleeping grandchild
  grandchild_ignores_sigterm
  rank_override, metadata_overrides               write a LoRA that is not the one asked for
  step_metadata_overrides                         the same, for the step LoRAs only
  skip_save                                       exit 0 after training without saving
  partial_save_then_hang                          write half the final file, then hang in the save
  hold_at_step, release_file                      at that step, wait until the file exists (a test's "finish now")
  record                                          write {argv, pid, pgid, ppid, env, t, umask, fds} as JSON at start
  flood_bytes                                     after step 1, redraw the bar until this many bytes are written
  bnb_warning                                     print the bitsandbytes CPU warning first, as on the capture box
  sample_step_s, oom_in_sampling_at_step          a sampler step's sleep; a CUDA OOM in the pass at that step
                                                  (sd_samples.py: the sample passes, as the real ones)
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import random
import signal
import struct
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

import sd_samples  # beside this script, as sd-scripts' library/ is beside its own
import sd_states

HERE = os.path.dirname(os.path.abspath(__file__))
IMAGE_EXTENSIONS = [".png", ".jpg", ".jpeg", ".webp", ".bmp"]
IMAGE_EXTENSIONS += [ext.upper() for ext in IMAGE_EXTENSIONS]
TOKENIZERS = ["openai/clip-vit-large-patch14", "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k"]
PHASES = ["launching", "loading_model", "caching_latents", "caching_text_encoder_outputs", "preparing_training",
          "training", "sampling", "saving"]


def load_modes() -> dict:
    try:
        with open("fake_trainer.json") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}


MODES = load_modes()


def log(msg: str) -> None:
    # --console_log_simple: logging.StreamHandler(sys.stdout) with "%(message)s"; flushed per record.
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def sleep(key: str, default: float) -> None:
    time.sleep(float(MODES.get(key, default)))


def phase(name: str) -> None:
    if MODES.get("hang_in") == name:
        while True:
            time.sleep(3600)


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add = p.add_argument
    # library/utils.py add_logging_arguments
    add("--console_log_level", type=str, default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    add("--console_log_file", type=str, default=None)
    add("--console_log_simple", action="store_true")
    # train_util.add_sd_models_arguments / sdxl
    add("--v2", action="store_true")
    add("--v_parameterization", action="store_true")
    add("--pretrained_model_name_or_path", type=str, default=None)
    add("--tokenizer_cache_dir", type=str, default=None)
    add("--vae", type=str, default=None)
    # train_util.add_dataset_arguments
    add("--train_data_dir", type=str, default=None)
    add("--reg_data_dir", type=str, default=None)
    add("--shuffle_caption", action="store_true")
    add("--caption_separator", type=str, default=",")
    add("--caption_extension", type=str, default=".caption")
    add("--caption_extention", type=str, default=None)
    add("--keep_tokens", type=int, default=0)
    add("--caption_prefix", type=str, default=None)
    add("--caption_suffix", type=str, default=None)
    add("--color_aug", action="store_true")
    add("--flip_aug", action="store_true")
    add("--random_crop", action="store_true")
    add("--resolution", type=str, default=None)
    add("--cache_latents", action="store_true")
    add("--vae_batch_size", type=int, default=1)
    add("--cache_latents_to_disk", action="store_true")
    add("--skip_cache_check", action="store_true")
    add("--enable_bucket", action="store_true")
    add("--min_bucket_reso", type=int, default=256)
    add("--max_bucket_reso", type=int, default=1024)
    add("--bucket_reso_steps", type=int, default=64)
    add("--bucket_no_upscale", action="store_true")
    add("--dataset_config", type=str, default=None)
    # train_util.add_training_arguments
    add("--output_dir", type=str, default=None)
    add("--output_name", type=str, default=None)
    add("--huggingface_repo_id", type=str, default=None)
    add("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"])
    add("--save_every_n_epochs", type=int, default=None)
    add("--save_every_n_steps", type=int, default=None)
    add("--save_n_epoch_ratio", type=int, default=None)
    add("--save_last_n_epochs", type=int, default=None)
    add("--save_last_n_epochs_state", type=int, default=None)
    add("--save_last_n_steps", type=int, default=None)
    add("--save_last_n_steps_state", type=int, default=None)
    add("--save_state", action="store_true")
    add("--save_state_on_train_end", action="store_true")
    add("--resume", type=str, default=None)
    add("--train_batch_size", type=int, default=1)
    add("--max_token_length", type=int, default=None, choices=[None, 150, 225])
    add("--mem_eff_attn", action="store_true")
    add("--xformers", action="store_true")
    add("--sdpa", action="store_true")
    add("--max_train_steps", type=int, default=1600)
    add("--max_train_epochs", type=int, default=None)
    add("--max_data_loader_n_workers", type=int, default=8)
    add("--persistent_data_loader_workers", action="store_true")
    add("--seed", type=int, default=None)
    add("--gradient_checkpointing", action="store_true")
    add("--gradient_accumulation_steps", type=int, default=1)
    add("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    add("--full_fp16", action="store_true")
    add("--full_bf16", action="store_true")
    add("--fp8_base", action="store_true")
    add("--clip_skip", type=int, default=None)
    add("--logging_dir", type=str, default=None)
    add("--log_with", type=str, default=None, choices=["tensorboard", "wandb", "all"])
    add("--log_prefix", type=str, default=None)
    add("--noise_offset", type=float, default=None)
    add("--min_snr_gamma", type=float, default=None)
    add("--loss_type", type=str, default="l2", choices=["l1", "l2", "huber", "smooth_l1"])
    add("--lowram", action="store_true")
    add("--highvram", action="store_true")
    add("--config_file", type=str, default=None)
    add("--output_config", action="store_true")
    add("--prior_loss_weight", type=float, default=1.0)
    add("--sample_every_n_steps", type=int, default=None)
    add("--sample_at_first", action="store_true")
    add("--sample_every_n_epochs", type=int, default=None)
    add("--sample_prompts", type=str, default=None)
    add("--sample_sampler", type=str, default="ddim", choices=[
        "ddim", "pndm", "lms", "euler", "euler_a", "heun", "dpm_2", "dpm_2_a", "dpmsolver", "dpmsolver++",
        "dpmsingle", "k_lms", "k_euler", "k_euler_a", "k_dpm_2", "k_dpm_2_a"])
    # train_util.add_optimizer_arguments
    add("--optimizer_type", type=str, default="")
    add("--use_8bit_adam", action="store_true")
    add("--learning_rate", type=float, default=2.0e-6)
    add("--max_grad_norm", type=float, default=1.0)
    add("--optimizer_args", type=str, default=None, nargs="*")
    add("--lr_scheduler", type=str, default="constant")
    add("--lr_warmup_steps", type=float, default=0)
    add("--lr_scheduler_num_cycles", type=int, default=1)
    add("--lr_scheduler_power", type=float, default=1)
    # train_network.setup_parser
    add("--no_metadata", action="store_true")
    add("--save_model_as", type=str, default="safetensors", choices=[None, "ckpt", "pt", "safetensors"])
    add("--unet_lr", type=float, default=None)
    add("--text_encoder_lr", type=float, default=None, nargs="*")
    add("--fp8_base_unet", action="store_true")
    add("--network_weights", type=str, default=None)
    add("--network_module", type=str, default=None)
    add("--network_dim", type=int, default=None)
    add("--network_alpha", type=float, default=1)
    add("--network_dropout", type=float, default=None)
    add("--network_args", type=str, default=None, nargs="*")
    add("--network_train_unet_only", action="store_true")
    add("--network_train_text_encoder_only", action="store_true")
    add("--training_comment", type=str, default=None)
    add("--dim_from_weights", action="store_true")
    add("--scale_weight_norms", type=float, default=None)
    add("--base_weights", type=str, default=None, nargs="*")
    add("--no_half_vae", action="store_true")
    add("--skip_until_initial_step", action="store_true")
    add("--initial_epoch", type=int, default=None)
    add("--initial_step", type=int, default=None)
    # sdxl_train_util.add_sdxl_training_arguments
    add("--cache_text_encoder_outputs", action="store_true")
    add("--cache_text_encoder_outputs_to_disk", action="store_true")
    add("--disable_mmap_load_safetensors", action="store_true")
    # sai_model_spec
    add("--metadata_title", type=str, default=None)
    add("--metadata_author", type=str, default=None)
    add("--metadata_trigger_phrase", type=str, default=None)
    return p


CLASS_TOKENS: dict[str, str] = {}  # each subset's class tokens, by its image_dir


def scan_dataset(args: argparse.Namespace) -> tuple[list[tuple[str, int, list[str]]], int]:
    """[(folder path, repeats, image paths)], images with repeats — as config_util / train_util do."""
    if args.dataset_config is not None:
        return scan_dataset_config(args)
    log("Using DreamBooth method.")
    subsets = []
    base = args.train_data_dir
    if base is None or not os.path.isdir(base):
        return [], 0
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if not os.path.isdir(path):
            continue
        tokens = name.split("_")
        try:
            repeats = int(tokens[0])
        except ValueError:
            log(f"ignore directory without repeats / 繰り返し回数のないディレクトリを無視します: {name}")
            continue
        if repeats < 1:
            continue
        CLASS_TOKENS[path] = name.split("_", 1)[1]
        subsets.append((path, repeats, glob_images(path)))
    return subsets, sum(r * len(i) for _, r, i in subsets)


def glob_images(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if os.path.splitext(f)[1] in IMAGE_EXTENSIONS)


def scan_dataset_config(args: argparse.Namespace) -> tuple[list[tuple[str, int, list[str]]], int]:
    """train_network.py L518-528 and config_util.load_user_config: the TOML's DreamBooth subsets (read by the toml
    package there, by tomllib here: the worker writes only literal strings, which both read alike)."""
    import tomllib

    log(f"Loading dataset config from {args.dataset_config}")
    if not os.path.isfile(args.dataset_config):
        raise ValueError(f"file not found / ファイルが見つかりません: {args.dataset_config}")
    with open(args.dataset_config, "rb") as fh:
        config = tomllib.load(fh)
    ignored = ["train_data_dir", "reg_data_dir"]
    if any(getattr(args, attr) is not None for attr in ignored):
        log("ignoring the following options because config file is found: {0} / 設定ファイルが利用されるため以下の"
            "オプションは無視されます: {0}".format(", ".join([*ignored, "in_json"])))
    subsets = []
    for dataset in config.get("datasets", []):
        for subset in dataset.get("subsets", []):
            path = subset["image_dir"]
            CLASS_TOKENS[path] = subset.get("class_tokens")
            subsets.append((path, int(subset.get("num_repeats", 1)), glob_images(path) if os.path.isdir(path) else []))
    return subsets, sum(r * len(i) for _, r, i in subsets)


def read_caption(img_path: str, caption_extension: str) -> str | None:
    """train_util.read_caption: the first line of `<stem><caption_extension>`, if there is one."""
    cap_path = os.path.splitext(img_path)[0] + caption_extension
    if not os.path.isfile(cap_path):
        return None
    try:
        with open(cap_path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        log(f"illegal char in file (not UTF-8) / ファイルにUTF-8以外の文字があります: {cap_path}")
        raise
    assert len(lines) > 0, f"caption file is empty / キャプションファイルが空です: {cap_path}"
    return lines[0].strip()


def load_dreambooth_dir(args: argparse.Namespace, images: list[str], class_tokens: str | None) -> list[str]:
    """Each image's caption, or the subset's class tokens where it has no caption file (train_util.py L2068-2078)."""
    return [read_caption(image, args.caption_extension) or class_tokens or ""
            for image in tqdm(images, desc="read caption")]


def dataset_block(args: argparse.Namespace, subsets: list) -> str:
    res = args.resolution.split(",")[0] if args.resolution else "None"
    lines = ["[Dataset 0]", f"  batch_size: {args.train_batch_size}", f"  resolution: ({res}, {res})",
             "  resize_interpolation: None", f"  enable_bucket: {args.enable_bucket}"]
    if args.enable_bucket:
        lines += [f"  min_bucket_reso: {args.min_bucket_reso}", f"  max_bucket_reso: {args.max_bucket_reso}",
                  f"  bucket_reso_steps: {args.bucket_reso_steps}", f"  bucket_no_upscale: {args.bucket_no_upscale}"]
    for i, (path, repeats, images) in enumerate(subsets):
        class_tokens = CLASS_TOKENS.get(path)
        lines += ["", f"  [Subset {i} of Dataset 0]", f'    image_dir: "{path}"', f"    image_count: {len(images)}",
                  f"    num_repeats: {repeats}", "    shuffle_caption: False", "    keep_tokens: 0",
                  "    caption_dropout_rate: 0.0", "    caption_dropout_every_n_epochs: 0",
                  "    caption_tag_dropout_rate: 0.0", "    caption_prefix: None", "    caption_suffix: None",
                  "    color_aug: False", "    flip_aug: False", "    face_crop_aug_range: None",
                  "    random_crop: False", "    token_warmup_min: 1,", "    token_warmup_step: 0,",
                  "    alpha_mask: False", "    resize_interpolation: None", "    custom_attributes: {}",
                  "    is_reg: False", f"    class_tokens: {class_tokens}",
                  f"    caption_extension: {args.caption_extension}"]
    return "\n".join(lines + ["", ""])  # two blank lines close the dataset, subsets or none (the capture)


def make_buckets(args: argparse.Namespace, images: list[str], total: int) -> None:
    """train_util.BaseDataset.make_buckets: what it logs with and without --enable_bucket."""
    log("loading image sizes.")
    for _ in tqdm(images):
        pass
    if not args.enable_bucket:
        log("prepare dataset")
        return
    log("make buckets")
    if args.bucket_no_upscale:
        log("min_bucket_reso and max_bucket_reso are ignored if bucket_no_upscale is set, because bucket reso is "
            "defined by image size automatically / bucket_no_upscaleが指定された場合は、bucketの解像度は画像サイズから"
            "自動計算されるため、min_bucket_resoとmax_bucket_resoは無視されます")
    res = (args.resolution or "1024").split(",")[0]
    log("number of images (including repeats) / 各bucketの画像枚数（繰り返し回数を含む）")
    log(f"bucket 0: resolution ({res}, {res}), count: {total}")
    log("mean ar error (without repeats): 0.0")


# -- the tokenizers: strategy_base._load_tokenizer and transformers' CLIPTokenizer, as far as a run shows them ----

VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when tokenizer_config.json does not say


class CLIPTokenizer:
    def __init__(self, vocab_file: str | None, model_max_length: int) -> None:
        with open(vocab_file, encoding="utf-8") as fh:  # type: ignore[arg-type]  # None: the offline TypeError
            json.load(fh)
        self.model_max_length = model_max_length

    @classmethod
    def from_pretrained(cls, folder: str) -> CLIPTokenizer:
        vocab = os.path.join(folder, "vocab.json")
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as fh:
                config = json.load(fh)
        return cls(vocab if os.path.isfile(vocab) else None, config.get("model_max_length", VERY_LARGE_INTEGER))

    def __call__(self, text: str, max_length: int) -> list[int]:
        ids = [49406, 49407]
        attention_mask = [1] * len(ids)
        difference = max_length - len(ids)
        # tokenization_utils_base._pad: with max_length 10^30 this is fail_tokenizer_hollow.log's OverflowError
        attention_mask = attention_mask + [0] * difference
        return ids + [49407] * difference


def _load_tokenizer(model_id: str, tokenizer_cache_dir: str | None) -> CLIPTokenizer:
    local = os.path.join(tokenizer_cache_dir or "", model_id.replace("/", "_"))
    if tokenizer_cache_dir and os.path.exists(local):
        log(f"load tokenizer from cache: {local}")
        return CLIPTokenizer.from_pretrained(local)
    # offline with nothing cached: transformers gets no vocab_file (fail_no_tokenizer_offline
    # in docs/reference/sd-scripts-failures.md)
    return CLIPTokenizer.from_pretrained(os.path.join(os.sep, "nonexistent", model_id))


def _get_input_ids(tokenizer: CLIPTokenizer, text: str, max_length: int) -> list[int]:
    return tokenizer(text, max_length=max_length)


def tokenize(tokenizers: list[CLIPTokenizer], captions: list[str]) -> list[list[int]]:
    """strategy_sdxl.SdxlTokenizeStrategy.tokenize: max_length is the tokenizer's model_max_length."""
    return [_get_input_ids(t, text, t.model_max_length) for t in tokenizers for text in captions]


# -- the base model: sdxl_model_util.load_models_from_sdxl_checkpoint ----------------------------------------------

# What each model sd-scripts builds expects, by checkpoint prefix; the keys and shapes come from the real
# checkpoint's header (copied next to this script by the test install, from tests/data).
MODELS = [("SdxlUNet2DConditionModel", "model.diffusion_model.", True), ("CLIPTextModel",
           "conditioner.embedders.0.transformer.", True), ("CLIPTextModelWithProjection",
           "conditioner.embedders.1.model.", True), ("AutoencoderKL", "first_stage_model.", False)]
DROPPED = {"conditioner.embedders.1.model.logit_scale", "conditioner.embedders.0.transformer.text_model.embeddings."
           "position_ids"}
VAE_LINEAR_ATTENTION = tuple(f"mid.attn_1.{n}.weight" for n in ("q", "k", "v", "proj_out"))  # conv_attn_to_linear


def read_safetensors_header(path: str) -> dict:
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    return header


def _load_state_dict_on_device(model: str, expected: dict[str, list[int]], state_dict: dict[str, dict],
                               strict: bool) -> str:
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected] if strict else []
    if missing and not strict:
        raise KeyError(missing[0])  # model_util.convert_ldm_vae_checkpoint indexes the keys it needs
    if missing or unexpected:
        error_msgs: list[str] = []
        if missing:
            error_msgs.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
        if unexpected:
            error_msgs.insert(0, "Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in unexpected)))
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(model, "\n\t".join(error_msgs)))
    for key, want in expected.items():
        have = list(state_dict[key]["shape"])
        if have != want and not (key.endswith(VAE_LINEAR_ATTENTION) and have == want[:2]):
            # accelerate's set_module_tensor_to_device
            raise ValueError(f'Trying to set a tensor of shape torch.Size({have}) in "{key.rsplit(".", 1)[-1]}" '
                             f"(which has shape torch.Size({want})), this looks incorrect.")
    return "<All keys matched successfully>"


def load_models_from_sdxl_checkpoint(path: str) -> None:
    with open(os.path.join(HERE, "sdxl-checkpoint-header.json")) as fh:
        reference = json.load(fh)["tensors"]
    state_dict = read_safetensors_header(path)
    steps = {"SdxlUNet2DConditionModel": ("building U-Net", "loading U-Net from checkpoint", "U-Net"),
             "CLIPTextModel": ("building text encoders", "loading text encoders from checkpoint", "text encoder 1"),
             "CLIPTextModelWithProjection": (None, None, "text encoder 2"),
             "AutoencoderKL": ("building VAE", "loading VAE from checkpoint", "VAE")}
    for model, prefix, strict in MODELS:
        building, loading, name = steps[model]
        for line in (building, loading):
            if line:
                log(line)
        if loading:
            sleep("load_s", 0.02)
        expected = {k[len(prefix):]: v["shape"] for k, v in reference.items() if k.startswith(prefix)
                    and k not in DROPPED}
        part = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix) and k not in DROPPED}
        log(f"{name}: {_load_state_dict_on_device(model, expected, part, strict)}")


def load_target_model(args: argparse.Namespace) -> None:
    log("loading model for process 0/1")
    path = args.pretrained_model_name_or_path
    if path is None or not os.path.isfile(path):
        # sdxl_train_util: not a file → treated as a Diffusers dir or repo id; diffusers raises ValueError.
        log(f"load Diffusers pretrained models: {path}, variant=None")
        raise ValueError(f'The provided pretrained_model_name_or_path "{path}" is neither a valid local path nor '
                         "a valid repo id. Please check the parameter.")
    log(f"load StableDiffusion checkpoint: {path}")
    phase("loading_model")
    held = b"\1" * (int(MODES.get("load_mb", 0)) << 20)  # the real loader holds the checkpoint in host RAM
    load_models_from_sdxl_checkpoint(path)
    del held


def caching_latents(images: list[str]) -> None:
    log("[Dataset 0]")
    log("caching latents with caching strategy.")
    log("caching latents...")
    phase("caching_latents")
    for _ in tqdm(images):
        sleep("cache_s", 0.002)
    log("move vae and unet to cpu to save memory")


def caching_text_encoder_outputs(tokenizers: list[CLIPTokenizer], captions: list[str]) -> None:
    log("[Dataset 0]")
    log("caching Text Encoder outputs with caching strategy.")
    log("checking cache validity...")
    for _ in tqdm(captions):
        pass
    log("caching Text Encoder outputs...")
    phase("caching_text_encoder_outputs")
    for caption in tqdm(captions):
        tokenize(tokenizers, [caption])
        sleep("cache_s", 0.002)
    log("move vae and unet back to original device")



def sha256_of(path: str) -> str:
    """train_util.calculate_sha256: the whole base checkpoint (what `sha_s` stands in for).

    One departure: the test checkpoint is a sparse 6.9 GB file (real offsets, no weights), and hashing its
    zeros would cost every test job ~15 s. A file with holes is hashed as its written extents, each with its
    offset, and its size: as unique to the file, in milliseconds. A file without holes gets the real sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        extents = _data_extents(fh.fileno(), size)
        if extents == [(0, size)]:
            while block := fh.read(1 << 20):
                digest.update(block)
            return digest.hexdigest()
        digest.update(f"sparse {size}".encode())
        for begin, end in extents:
            fh.seek(begin)
            digest.update(f" {begin}:{end}".encode() + fh.read(end - begin))
    return digest.hexdigest()


def _data_extents(fd: int, size: int) -> list:
    """The file's written (begin, end) ranges, by SEEK_DATA/SEEK_HOLE; the whole file where they are unknown."""
    extents, at = [], 0
    try:
        while at < size:
            begin = os.lseek(fd, at, os.SEEK_DATA)
            at = os.lseek(fd, begin, os.SEEK_HOLE)
            extents.append((begin, at))
    except OSError as exc:  # ENXIO: no data past `at`; anything else: a file system without hole reporting
        if exc.errno != errno.ENXIO:
            return [(0, size)]
    return extents


def legacy_model_hash(path: str) -> str:
    """train_util.model_hash: sha256 of 64 KiB at 1 MiB in, first 8 hex digits (of nothing, for a small file)."""
    with open(path, "rb") as fh:
        fh.seek(0x100000)
        return hashlib.sha256(fh.read(0x10000)).hexdigest()[:8]


def lora_metadata(args: argparse.Namespace, rank: int, steps: int, epoch: int, total_images: int,
                  subsets: list, started: float) -> dict[str, str]:
    """The real run's `ss_*` metadata (tests/data/lora-header-run1_simple.json) with this run's values."""
    metadata = dict(lora_reference()["__metadata__"])
    res = (args.resolution or "1024").split(",")[0]
    batches = batches_per_epoch(args, subsets)
    buckets = {"buckets": {"0": {"resolution": [int(res), int(res)], "count": total_images}}, "mean_img_ar_error": 0.0}
    metadata.update({
        "ss_num_batches_per_epoch": str(batches), "ss_num_epochs": str(math.ceil(args.max_train_steps / batches)),
        "ss_bucket_info": json.dumps(buckets) if args.enable_bucket else "null",
        "ss_min_bucket_reso": str(args.min_bucket_reso) if args.enable_bucket else "None",
        "ss_max_bucket_reso": str(args.max_bucket_reso) if args.enable_bucket else "None",
        "ss_bucket_no_upscale": str(args.bucket_no_upscale),
        "ss_network_dim": str(rank), "ss_network_alpha": str(float(args.network_alpha)),
        "ss_network_module": args.network_module or "networks.lora", "ss_output_name": str(args.output_name),
        "ss_steps": str(steps), "ss_epoch": str(epoch), "ss_seed": str(args.seed),
        "ss_max_train_steps": str(args.max_train_steps), "ss_learning_rate": str(args.learning_rate),
        "ss_lr_scheduler": args.lr_scheduler, "ss_mixed_precision": args.mixed_precision,
        "ss_optimizer": "bitsandbytes.optim.adamw.AdamW8bit" if args.optimizer_type.lower() == "adamw8bit"
        else "torch.optim.adamw.AdamW",
        "ss_min_snr_gamma": str(args.min_snr_gamma), "ss_noise_offset": str(args.noise_offset),
        "ss_max_grad_norm": str(args.max_grad_norm), "ss_resolution": f"({res}, {res})",
        "ss_batch_size_per_device": str(args.train_batch_size), "ss_num_train_images": str(total_images),
        "ss_enable_bucket": str(args.enable_bucket),
        "ss_dataset_dirs": json.dumps({os.path.basename(p): {"n_repeats": r, "img_count": len(i)}
                                       for p, r, i in subsets}),
        "ss_sd_model_name": os.path.basename(args.pretrained_model_name_or_path),
        "ss_sd_model_hash": legacy_model_hash(args.pretrained_model_name_or_path),
        "ss_new_sd_model_hash": sha256_of(args.pretrained_model_name_or_path),
        "ss_sd_scripts_commit_hash": MODES.get("commit_hash", "48d368fa557731ad0488c07304dfeba8c07910eb"),
        "ss_training_started_at": str(started), "ss_training_finished_at": str(time.time()),
        "modelspec.title": str(args.output_name), "modelspec.resolution": f"{res}x{res}",
    })
    if args.network_args:
        metadata["ss_network_args"] = json.dumps(dict(a.split("=", 1) for a in args.network_args))
    if args.dataset_config is not None:
        user_config_metadata(metadata, args, subsets, total_images, buckets)
    metadata.update(MODES.get("metadata_overrides", {}))
    return metadata


# What train_network.py L1069-1158 writes only without a --dataset_config (L1159-1200); with one, these go and the
# same facts are in `ss_datasets` (one entry per dataset, its subsets inside).
WITHOUT_CONFIG_ONLY = (
    "ss_batch_size_per_device", "ss_total_batch_size", "ss_resolution", "ss_color_aug", "ss_flip_aug",
    "ss_random_crop", "ss_shuffle_caption", "ss_enable_bucket", "ss_bucket_no_upscale", "ss_min_bucket_reso",
    "ss_max_bucket_reso", "ss_keep_tokens", "ss_reg_dataset_dirs", "ss_bucket_info")


def user_config_metadata(metadata: dict[str, str], args: argparse.Namespace, subsets: list, total: int,
                         buckets: dict) -> None:
    res = int((args.resolution or "1024").split(",")[0])
    for key in WITHOUT_CONFIG_ONLY:
        metadata.pop(key, None)
    tags = json.loads(metadata["ss_tag_frequency"])
    tag_frequency = {os.path.basename(p): next(iter(tags.values()), {}) for p, _, _ in subsets}
    metadata["ss_datasets"] = json.dumps([{
        "is_dreambooth": True, "batch_size_per_device": args.train_batch_size, "num_train_images": total,
        "num_reg_images": 0, "resolution": [res, res], "enable_bucket": bool(args.enable_bucket),
        "min_bucket_reso": args.min_bucket_reso, "max_bucket_reso": args.max_bucket_reso,
        "tag_frequency": tag_frequency, "bucket_info": buckets if args.enable_bucket else None,
        "resize_interpolation": None,
        "subsets": [{"img_count": len(i), "num_repeats": r, "color_aug": False, "flip_aug": False,
                     "random_crop": False, "shuffle_caption": False, "keep_tokens": 0, "keep_tokens_separator": "",
                     "secondary_separator": None, "enable_wildcard": False, "caption_prefix": None,
                     "caption_suffix": None, "resize_interpolation": None, "image_dir": os.path.basename(p),
                     "class_tokens": CLASS_TOKENS.get(p), "is_reg": False} for p, r, i in subsets]}])
    metadata["ss_tag_frequency"] = json.dumps(tag_frequency)


# --save_precision: network.save_weights casts every tensor to it; without it (or "float") they stay float32.
SAVE_DTYPES = {None: "F32", "float": "F32", "fp16": "F16", "bf16": "BF16"}
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2}


def encode_scalar(value: float, dtype: str) -> bytes:
    if dtype == "F16":
        return struct.pack("<e", value)
    if dtype == "BF16":
        return struct.pack("<f", value)[2:]  # bfloat16 is float32's upper half (little-endian: its last 2 bytes)
    return struct.pack("<f", value)


def save_lora(path: str, rank: int, alpha: float, metadata: dict[str, str], partial: bool = False,
              precision: str | None = None) -> None:
    """A safetensors file as safetensors' serializer lays it out; tensor bytes left sparse (zeros)."""
    dtype = SAVE_DTYPES[precision]
    modules = lora_modules()
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    alphas = []
    for name, in_features, out_features in modules:
        for key, shape in ((f"{name}.alpha", []), (f"{name}.lora_down.weight", [rank, in_features]),
                           (f"{name}.lora_up.weight", [out_features, rank])):
            size = DTYPE_SIZES[dtype] * math.prod(shape)
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            if key.endswith(".alpha"):
                alphas.append(offset)
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the serializer pads the header to 8 bytes
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        data_start = fh.tell()
        for at in alphas:
            fh.seek(data_start + at)
            fh.write(encode_scalar(alpha, dtype))
        fh.truncate(data_start + (offset // 2 if partial else offset))


def lora_modules() -> list[tuple[str, int, int]]:
    """(module, in_features, out_features) of the 722 U-Net modules of the real run's LoRA (its header, copied
    next to this script by the test install from tests/data/lora-header-run1_simple.json)."""
    tensors = lora_reference()["tensors"]
    return [(name[:-len(".lora_down.weight")], info["shape"][1],
             tensors[name[:-len(".lora_down.weight")] + ".lora_up.weight"]["shape"][0])
            for name, info in tensors.items() if name.endswith(".lora_down.weight")]


def lora_reference() -> dict:
    with open(os.path.join(HERE, "lora-header-run1_simple.json")) as fh:
        return json.load(fh)


class OutOfMemoryError(RuntimeError):
    """Shown in tracebacks as `torch.OutOfMemoryError: CUDA out of memory. …`, as current torch does."""


OutOfMemoryError.__module__ = "torch"


@dataclass
class Dataset:
    subsets: list[tuple[str, int, list[str]]]
    images: list[str]
    captions: list[str]
    total: int  # images with repeats


@dataclass
class Plan:
    rank: int
    steps: int
    epochs: int
    batches: int  # per epoch
    steps_from_state: int | None = None  # train_state.json's current_step, when resumed


def train(args: argparse.Namespace) -> int:
    """train_network.NetworkTrainer.train, one function per phase (named as lora_worker's Phase names them)."""
    started = time.time()
    if MODES.get("bnb_warning"):
        sys.stderr.write("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. "
                         "Please make sure you already `pip install kernels` and the kernels >= 0.11.1\n")
    tokenizers, dataset = launching(args)
    if dataset is None:
        return 0  # "No data found": sd-scripts returns, exit status 0, no file
    loading_model(args)
    caching_latents(dataset.images)
    caching_text_encoder_outputs(tokenizers, dataset.captions)
    plan = preparing_training(args, dataset)
    step = training(args, dataset, plan, started)
    if MODES.get("skip_save"):
        BAR[0].close()
        return 0
    saving(args, dataset, plan, step, started)
    BAR[0].close()
    sleep("teardown_s", 0.0)
    return 0


def launching(args: argparse.Namespace) -> tuple[list[CLIPTokenizer], Dataset | None]:
    phase("launching")
    tokenizers = [_load_tokenizer(model_id, args.tokenizer_cache_dir) for model_id in TOKENIZERS]
    found, _ = scan_dataset(args)
    log("prepare images.")
    captions: list[str] = []
    for path, _, imgs in found:  # train_util load_dreambooth_dir, then the subset loop, per subset
        if not os.path.isdir(path):
            log(f"not directory: {path}")
            log(f"ignore subset with image_dir='{path}': no images found / "
                "画像が見つからないためサブセットを無視します")
            continue
        log("get image size from name of cache files")
        for _ in tqdm(imgs):
            pass
        log(f"set image size from cache files: 0/{len(imgs)}")
        log(f"found directory {path} contains {len(imgs)} image files")
        captions += load_dreambooth_dir(args, imgs, CLASS_TOKENS.get(path))
        if not imgs:
            log(f"ignore subset with image_dir='{path}': no images found / "
                "画像が見つからないためサブセットを無視します")
    subsets = [subset for subset in found if subset[2]]
    dataset = Dataset(subsets, [img for _, _, imgs in subsets for img in imgs], captions,
                      sum(r * len(i) for _, r, i in subsets))
    log(f"{dataset.total} train images with repeats.")
    log("0 reg images with repeats.")
    log("no regularization images / 正則化画像が見つかりませんでした")
    log(dataset_block(args, subsets))
    log("[Prepare dataset 0]")
    make_buckets(args, dataset.images, dataset.total)
    if dataset.total == 0:
        log("No data found. Please verify arguments (train_data_dir must be the parent of folders with images) / "
            "画像がありません。引数指定を確認してください（train_data_dirには画像があるフォルダではなく、"
            "画像があるフォルダの親フォルダを指定する必要があります）")
        return tokenizers, None
    assert args.network_train_unet_only or not args.cache_text_encoder_outputs, \
        "network for Text Encoder cannot be trained with caching Text Encoder outputs / " \
        "Text Encoderの出力をキャッシュしながらText Encoderのネットワークを学習することはできません"
    return tokenizers, dataset


def loading_model(args: argparse.Namespace) -> None:
    log("preparing accelerator")
    print("accelerator device: cuda", flush=True)
    load_target_model(args)
    if args.sdpa:
        log("Enable SDPA for U-Net")


def preparing_training(args: argparse.Namespace, dataset: Dataset) -> Plan:
    rank = int(MODES.get("rank_override", args.network_dim or 4))
    print(f"import network module: {args.network_module}", flush=True)
    phase("preparing_training")
    log(f"create LoRA network. base dim (rank): {args.network_dim or 4}, alpha: {float(args.network_alpha)}")
    log("neuron dropout: p=None, rank dropout: p=None, module dropout: p=None")
    log("create LoRA for Text Encoder 1:")
    log("create LoRA for Text Encoder 2:")
    log("create LoRA for Text Encoder: 264 modules.")
    log("create LoRA for U-Net: 722 modules.")
    log("enable LoRA for U-Net: 722 modules")
    print("prepare optimizer, data loader etc.", flush=True)
    eight_bit = args.optimizer_type.lower() == "adamw8bit"
    log(f"use {'8-bit AdamW' if eight_bit else 'AdamW'} optimizer | {{}}")
    batches = batches_per_epoch(args, dataset.subsets)
    steps = args.max_train_steps
    if args.max_train_epochs:
        steps = args.max_train_epochs * batches
        args.max_train_steps = steps
        log(f"override steps. steps for {args.max_train_epochs} epochs is / 指定エポックまでのステップ数: {steps}")
    epochs = math.ceil(steps / batches)
    steps_from_state = sd_states.resume_from_local_or_hf_if_specified(log, args) if args.resume else None
    print("running training / 学習開始", flush=True)
    print(f"  num train images * repeats / 学習画像の数×繰り返し回数: {dataset.total}", flush=True)
    print("  num validation images * repeats / 学習画像の数×繰り返し回数: 0", flush=True)
    print("  num reg images / 正則化画像の数: 0", flush=True)
    print(f"  num batches per epoch / 1epochのバッチ数: {batches}", flush=True)
    print(f"  num epochs / epoch数: {epochs}", flush=True)
    print(f"  batch size per device / バッチサイズ: {args.train_batch_size}", flush=True)
    print("  gradient accumulation steps / 勾配を合計するステップ数 = 1", flush=True)
    print(f"  total optimization steps / 学習ステップ数: {steps}", flush=True)
    sleep("sha_s", 0.02)  # the silent sha256 of the base model
    return Plan(rank, steps, epochs, batches, steps_from_state)


def batches_per_epoch(args: argparse.Namespace, subsets: list) -> int:
    return sum(math.ceil(r * len(i) / args.train_batch_size) for _, r, i in subsets)


BAR: list[tqdm] = []  # the steps bar, once training starts (closed after the final save, as when train() returns)


def initial_step_of(args: argparse.Namespace, plan: Plan) -> tuple[int, int]:
    """train_network.py L1232-1273: (initial_step, epoch_to_start) from --initial_step/--initial_epoch or the
    resumed state. Without --skip_until_initial_step only the epoch is skipped and the steps count from 0."""
    initial_step = 0
    if args.initial_epoch is not None or args.initial_step is not None:
        if plan.steps_from_state is not None:
            log("steps from the state is ignored because initial_step is specified / "
                "initial_stepが指定されているため、stateからのステップ数は無視されます")
        initial_step = args.initial_step if args.initial_step is not None else (args.initial_epoch - 1) * plan.batches
    elif plan.steps_from_state is not None:
        initial_step = plan.steps_from_state
    if initial_step > 0:
        assert args.max_train_steps > initial_step, (
            "max_train_steps should be greater than initial step / "
            f"max_train_stepsは初期ステップより大きい必要があります: {args.max_train_steps} vs {initial_step}")
    epoch_to_start = 0
    if initial_step > 0:
        if args.skip_until_initial_step:
            if not args.resume:
                log("initial_step is specified but not resuming. lr scheduler will be started from the beginning / "
                    "initial_stepが指定されていますがresumeしていないため、lr schedulerは最初から始まります")
            log(f"skipping {initial_step} steps / {initial_step}ステップをスキップします")
            initial_step *= args.gradient_accumulation_steps
            epoch_to_start = initial_step // math.ceil(plan.batches / args.gradient_accumulation_steps)
        else:
            epoch_to_start = initial_step // math.ceil(plan.batches / args.gradient_accumulation_steps)
            initial_step = 0  # do not skip
    return initial_step, epoch_to_start


def training(args: argparse.Namespace, dataset: Dataset, plan: Plan, started: float) -> int:
    """The loop of train_network.py L1340-1605, its step count included: after a resume with
    --skip_until_initial_step past the first epoch, global_step restarts at the steps into the current epoch
    (L1340-1344: the skipped epochs' batches are taken off initial_step), not at the resumed step. That is the
    real trainer's bug (issue 26); the double keeps it."""
    initial_step, epoch_to_start = initial_step_of(args, plan)
    global_step = 0
    if initial_step > 0:
        for skip_epoch in range(epoch_to_start):
            log(f"skipping epoch {skip_epoch + 1} because initial_step (multiplied) is {initial_step}")
            initial_step -= plan.batches
        global_step = initial_step
    sample_images(args, 0, 0)  # --sample_at_first, before the skip and the bar (L1330-1333)
    dtype = "torch.bfloat16" if args.mixed_precision == "bf16" else "torch.float32"
    log(f"unet dtype: {dtype}, device: cuda:0")
    log("text_encoder [0] dtype: torch.float32, device: cpu")
    log("text_encoder [1] dtype: torch.float32, device: cpu")
    BAR.append(tqdm(range(args.max_train_steps - initial_step), smoothing=0, desc="steps"))
    phase("training")
    rng = random.Random(args.seed)
    losses: list[float] = []
    for epoch in range(epoch_to_start, plan.epochs):
        print(f"\nepoch {epoch + 1}/{plan.epochs}\n", flush=True)
        # the dataset's own epoch, which each process starts at 0 (train_util.py L784; R6 resumed into epoch 2)
        log(f"epoch is incremented. current_epoch: {epoch if epoch > epoch_to_start else 0}, epoch: {epoch + 1}")
        batches = range(plan.batches)
        if initial_step > 0:  # accelerator.skip_first_batches(train_dataloader, initial_step - 1)
            batches = range(initial_step - 1, plan.batches)
            initial_step = 1
        for _ in batches:
            if initial_step > 0:
                initial_step -= 1
                continue
            global_step = train_step(args, dataset, plan, epoch, global_step, started)
            nan = MODES.get("nan_from_step") is not None and global_step >= MODES["nan_from_step"]
            losses.append(float("nan") if nan else
                          1.1 * math.exp(-global_step / max(plan.steps, 1)) + rng.random() * 0.05)
            window = losses[-plan.batches:]
            BAR[0].set_postfix(avr_loss=sum(window) / len(window))
            if global_step >= args.max_train_steps:
                break
        if args.save_every_n_epochs and (epoch + 1) % args.save_every_n_epochs == 0 and epoch + 1 < plan.epochs:
            save_checkpoint(args, dataset, plan, f"-{epoch + 1:06d}", global_step, epoch + 1, started)
        sample_images(args, epoch + 1, global_step)  # every epoch's end (L1707): steps-only sampling skips it
    return global_step


def sample_images(args: argparse.Namespace, epoch: int | None, steps: int) -> None:
    sd_samples.sample_images(log, args, epoch, steps, MODES, OutOfMemoryError, phase)


def train_step(args: argparse.Namespace, dataset: Dataset, plan: Plan, epoch: int, global_step: int,
               started: float) -> int:
    """One optimizer step, and the step save that follows it (L1486-1509): the step LoRA, its state, then the
    older ones removed."""
    sleep("step_s", 0.005)
    fail_at(global_step + 1)
    BAR[0].update(1)
    global_step += 1
    if MODES.get("flood_bytes") and global_step == 1:
        flood(BAR[0], int(MODES["flood_bytes"]))
    sample_images(args, None, global_step)  # before the step's save, with no optimizer step between (L1491)
    if args.save_every_n_steps is not None and global_step % args.save_every_n_steps == 0:
        save_checkpoint(args, dataset, plan, f"-step{global_step:08d}", global_step, epoch, started)
        if args.save_state:
            sd_states.save_and_remove_state_stepwise(log, args, global_step, **state_of(args, plan, epoch + 1))
        remove = sd_states.get_remove_step_no(args, global_step)
        if remove is not None:
            old = os.path.join(args.output_dir, f"{args.output_name or 'at'}-step{remove:08d}.safetensors")
            if os.path.exists(old):
                print(f"removing old checkpoint: {old}", flush=True)
                os.remove(old)
    return global_step


def state_of(args: argparse.Namespace, plan: Plan, epoch: int) -> dict:
    return {"epoch": epoch, "modules": lora_modules(), "rank": plan.rank, "alpha": float(args.network_alpha),
            "lr": args.learning_rate}


def fail_at(step: int) -> None:
    if step == MODES.get("oom_at_step"):
        raise OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 23.57 GiB of "
            "which 11.06 MiB is free. Including non-PyTorch memory, this process has 23.55 GiB memory in use.")
    if step == MODES.get("crash_at_step"):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if step == MODES.get("hold_at_step"):
        while not os.path.exists(MODES["release_file"]):
            time.sleep(0.02)


def save_checkpoint(args: argparse.Namespace, dataset: Dataset, plan: Plan, suffix: str, step: int, epoch: int,
                    started: float) -> None:
    """train_network's save_model: the line, then the file, written in place (a kill mid-write leaves it cut)."""
    default = "at" if suffix.startswith("-step") else "epoch"
    ckpt = os.path.join(args.output_dir, f"{args.output_name or default}{suffix}.safetensors")
    os.makedirs(args.output_dir, exist_ok=True)  # save_model: the directory first, then the line
    print(f"\nsaving checkpoint: {ckpt}", flush=True)
    metadata = lora_metadata(args, plan.rank, step, epoch, dataset.total, dataset.subsets, started)
    metadata.update(MODES.get("step_metadata_overrides", {}) if suffix.startswith("-step") else {})
    save_lora(ckpt, plan.rank, args.network_alpha, metadata, precision=args.save_precision)


def saving(args: argparse.Namespace, dataset: Dataset, plan: Plan, step: int, started: float) -> None:
    os.makedirs(args.output_dir, exist_ok=True)  # only now: sd-scripts creates the output dir at the first save
    if args.save_state or args.save_state_on_train_end:  # the end state first (train_network.py L1722-1723)
        sd_states.save_state_on_train_end(log, args, step=step, **state_of(args, plan, plan.epochs))
    final = os.path.join(args.output_dir, f"{args.output_name or 'last'}.safetensors")
    print(f"\nsaving checkpoint: {final}", flush=True)
    metadata = lora_metadata(args, plan.rank, step, plan.epochs, dataset.total, dataset.subsets, started)
    if MODES.get("partial_save_then_hang"):
        save_lora(final, plan.rank, args.network_alpha, metadata, partial=True, precision=args.save_precision)
        phase_hang()
    phase("saving")
    save_lora(final, plan.rank, args.network_alpha, metadata, precision=args.save_precision)
    log("model saved.")



def phase_hang() -> None:
    while True:
        time.sleep(3600)


def flood(bar: tqdm, total_bytes: int) -> None:
    """Redraw the bar as fast as possible: the benchmark's 100 MB of realistic output."""
    written = 0
    i = 0
    line_every = 2000
    while written < total_bytes:
        bar.set_postfix(avr_loss=0.1 + (i % 97) / 1000)
        written += 80
        i += 1
        if i % line_every == 0:
            log(f"epoch is incremented. current_epoch: {i}, epoch: {i + 1}")
            written += 50


def spawn_grandchild() -> int | None:
    mode = MODES.get("grandchild")
    if not mode:
        return None
    pid = os.fork()
    if pid == 0:  # a forked copy of the trainer, as a DataLoader worker would be
        if mode == "session":
            os.setsid()
        if MODES.get("grandchild_ignores_sigterm"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(3600)
    return pid


def record(argv: list[str], grandchild: int | None) -> None:
    path = MODES.get("record")
    if path:
        with open(path + ".tmp", "w") as fh:
            mask = os.umask(0)
            os.umask(mask)  # reading the umask means setting it; put it back at once
            fds = {int(fd): os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}")}  # not the listing's own, closed by now
            json.dump({"argv": argv, "pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(),
                       "grandchild": grandchild, "env": dict(os.environ), "t": time.time(),
                       "umask": mask, "fds": {str(k): v for k, v in fds.items()}}, fh)
        os.replace(path + ".tmp", path)


def main() -> int:
    args = setup_parser().parse_args()
    if args.caption_extention is not None:
        args.caption_extension = args.caption_extention
    if MODES.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record(sys.argv, spawn_grandchild())
    return train(args)


if __name__ == "__main__":
    sys.exit(main())

"""The fixed command: golden argv for every tier x device, the env allow-list, and no argument injection."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import tomllib
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from lora_worker.web.schemas.job import OUTPUT_NAME, SUBJECT_CLASS, TRIGGER
from lora_worker.config import DEFAULT_DEVICES, LORA_TARGET_PRESETS, TIERS, Settings
from lora_worker.config_tables import SAVE_EVERY_N_STEPS
from lora_worker.dispatch.argv import (ENV_KEYS, SAMPLE_FLAGS, SCRIPT_FLAGS, SCRIPT_KEYS, build_argv, build_env,
                                      keep_last)
from lora_worker.dispatch.presentation import DatasetConfig, config_for
from lora_worker.errors import DatasetInvalid
from lora_worker.run.local import LocalBackend
from lora_worker.dispatch.request import ResolvedRequest, TrainRequest, resolve_request
from tests.helpers.examples import examples
from tests.helpers.fake_trainer import load_fake_trainer

SETTINGS = Settings(accelerate=Path("/opt/fluxgym/.venv/bin/accelerate"),
                    sd_scripts_dir=Path("/opt/fluxgym/sd-scripts"), tokenizer_cache_dir=Path("/opt/fluxgym/tokenizers"),
                    state_dir=Path("/var/lib/lora-worker"))
PATHS = ("dataset_dir", "base_model_path", "output_dir")
LOCAL = LocalBackend()


def request(**overrides: object) -> ResolvedRequest:
    """A request resolved as if its paths were the real paths dispatch found."""
    values = dict(dataset_dir="/worktank/arbo/train/t1/dataset", base_model_path="/worktank/models/sdxl.safetensors",
                  output_dir="/worktank/arbo/train/t1/output", output_name="ohwx_v1", trigger="ohwx",
                  subject_class="woman", repeats=10, tier="fast", device_index=1, seed=42)
    values.update(overrides)
    raw = TrainRequest(**values)  # type: ignore[arg-type]
    return resolve_request(raw, train_id="t1", **{k: Path(str(values[k])) for k in PATHS})


def prompts_path(res: int, prompts: list[tuple[str, int]] = (("photo of ohwx woman", 42),)) -> str:
    """Where the prompts file of these prompts at `res` px lies: the state dir's prompts/, named by the sha256 of
    its JSON, written out here (sd-scripts reads such a list of dicts as it is: train_util.py L6420-6447)."""
    document = [{"height": res, "negative_prompt": "lowres, blurry, jpeg artifacts, watermark, text",
                 "prompt": prompt, "sample_steps": 20, "scale": 7.0, "seed": seed, "width": res}
                for prompt, seed in prompts]
    data = json.dumps(document, separators=(",", ":")).encode()
    return f"/var/lib/lora-worker/prompts/{hashlib.sha256(data).hexdigest()[:32]}.json"


def config(req: ResolvedRequest, images: int = 20) -> DatasetConfig:
    return config_for(req, SETTINGS, LOCAL, images)


def argv_of(req: ResolvedRequest, settings: Settings = SETTINGS, images: int = 20) -> list[str]:
    return build_argv(req, settings, LOCAL, config_for(req, settings, LOCAL, images))


def golden(steps: int, dim: int, res: int, batch: int, extra: str = "", every: int = 100, samples: bool = True,
           dataset: str = "--train_data_dir=/worktank/arbo/train/t1/dataset") -> str:
    # With samples, every sampled step LoRA is kept (at most 8: keep_last(kept, every) = (kept - 1) * every + 1),
    # and the sample flags follow the keys; without, the one newest step LoRA.
    kept = (min(8, steps // every) - 1) * every + 1 if samples else 1
    sampled = (f" --sample_prompts={prompts_path(res)} --sample_every_n_steps={every} --sample_sampler=euler_a"
               if samples else "")
    return (
        "/opt/fluxgym/.venv/bin/accelerate launch --num_processes=1 --num_machines=1 --mixed_precision=bf16 "
        "--dynamo_backend=no --num_cpu_threads_per_process=4 /opt/fluxgym/sd-scripts/sdxl_train_network.py "
        "--pretrained_model_name_or_path=/worktank/models/sdxl.safetensors "
        f"--tokenizer_cache_dir=/opt/fluxgym/tokenizers {dataset} "
        "--output_dir=/worktank/arbo/train/t1/output --output_name=ohwx_v1 --save_model_as=safetensors "
        "--save_precision=fp16 "
        f"--caption_extension=.txt --resolution={res} --network_module=networks.lora --network_dim={dim} "
        f"--network_alpha={dim} {extra}--mixed_precision=bf16 --learning_rate=1e-4 --lr_scheduler=cosine "
        "--optimizer_type=AdamW8bit --min_snr_gamma=5 --noise_offset=0.1 --max_grad_norm=1.0 "
        f"--max_train_steps={steps} --save_every_n_steps={every} --save_last_n_steps={kept} "
        f"--save_last_n_steps_state=1 --train_batch_size={batch} --max_data_loader_n_workers=0 --seed=42{sampled} "
        "--network_train_unet_only --cache_latents --cache_text_encoder_outputs --gradient_checkpointing --sdpa "
        "--enable_bucket --bucket_no_upscale --console_log_simple --save_state"
        + (" --sample_at_first" if samples else "")
    )


@pytest.mark.parametrize("tier, device, expected", [
    ("fast", 0, golden(400, 16, 768, 1)),
    ("balanced", 0, golden(1500, 32, 768, 1, every=300)),
    ("fast", 1, golden(400, 16, 768, 2)),
    ("balanced", 1, golden(1500, 32, 768, 2, every=300)),
    ("quality", 1, golden(3000, 32, 1024, 2, every=500)),
])
def test_golden_argv_for_every_allowed_tier_and_device(tier, device, expected):
    """The dataset is the worker's config (its path names its content: test_the_dataset_config_is_exactly); a
    row accepted before it was `--train_data_dir`, which only its resume's fingerprint rebuilds (config None)."""
    assert tier in DEFAULT_DEVICES[device].tiers
    req = request(tier=tier, device_index=device)
    made = config(req)
    assert made.path.parent == Path("/var/lib/lora-worker/datasets")
    assert shlex.join(build_argv(req, SETTINGS, LOCAL, made)) == expected.replace(
        "--train_data_dir=/worktank/arbo/train/t1/dataset", f"--dataset_config={made.path}")
    assert shlex.join(build_argv(req, SETTINGS, LOCAL, None)) == expected


def test_the_dataset_config_is_exactly_the_kohya_folder_its_class_tokens_and_one_epochs_repeats():
    """20 images at batch 2 for 400 steps: 40 repeats make 400 batches, one epoch (39 would make 390)."""
    made = config(request(tier="fast", device_index=1), images=20)
    assert made.content == (b"[[datasets]]\n\n[[datasets.subsets]]\n"
                            b"image_dir = '/worktank/arbo/train/t1/dataset/10_ohwx woman'\n"
                            b"class_tokens = 'ohwx woman'\nnum_repeats = 40\n")
    assert made.path.name == hashlib.sha256(made.content).hexdigest() + ".toml"
    assert (made.presentation.repeats, made.presentation.steps_per_epoch, made.presentation.epochs) == (40, 400, 1)


def test_a_request_without_samples_draws_none_and_keeps_one_step_lora():
    argv = build_argv(request(samples=()), SETTINGS, LOCAL, None)
    assert shlex.join(argv) == golden(400, 16, 768, 2, samples=False)


def test_a_requests_prompts_are_the_files_each_with_its_seed_or_the_fixed_one():
    argv = argv_of(request(samples=({"prompt": "ohwx woman, red coat", "seed": 7}, {"prompt": "ohwx woman"})))
    assert f"--sample_prompts={prompts_path(768, [('ohwx woman, red coat', 7), ('ohwx woman', 43)])}" in argv


def test_optional_parameters_land_in_their_own_tokens():
    req = request(max_grad_norm=0.5, lora_target_modules="attn_mlp_conv")
    argv = build_argv(req, SETTINGS, LOCAL, None)
    assert "--max_grad_norm=0.5" in argv and "--network_args=conv_dim=16" in argv
    assert shlex.join(argv) == golden(400, 16, 768, 2, extra="--network_args=conv_dim=16 ").replace(
        "--max_grad_norm=1.0", "--max_grad_norm=0.5")


def test_env_is_exactly_the_allow_list():
    env = build_env(request(device_index=1), SETTINGS, LOCAL)
    assert tuple(env) == ENV_KEYS
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["PYTHONUNBUFFERED"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_HOME"] == "/var/lib/lora-worker/hf"
    assert not {"LD_PRELOAD", "PYTHONPATH"} & set(env)


def argv_is_fixed_shape(argv: list[str], settings: Settings) -> None:
    script = argv.index(str(settings.train_script))
    assert argv[:script + 1] == argv_of(request(), settings)[:script + 1]
    for token in argv[script + 1:]:
        if token in SCRIPT_FLAGS + SAMPLE_FLAGS:
            continue
        assert token.startswith("--") and "=" in token, token
        key = token[2:].split("=", 1)[0]
        assert key in SCRIPT_KEYS, token


names = st.from_regex(OUTPUT_NAME, fullmatch=True)
triggers = st.from_regex(TRIGGER, fullmatch=True)
classes = st.from_regex(SUBJECT_CLASS, fullmatch=True).filter(lambda s: len(s) <= 48)
path_parts = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\x00"),
                     min_size=1, max_size=20).filter(lambda p: p not in (".", ".."))
paths = st.lists(path_parts, min_size=1, max_size=5).map(lambda parts: "/" + "/".join(parts))


@hsettings(max_examples=examples(300), deadline=None)
@given(dataset=paths, output=paths, model=paths, name=names, trigger=triggers, subject=classes,
       repeats=st.integers(1, 100), seed=st.integers(0, 2**31 - 1),
       tier_device=st.sampled_from([("fast", 0), ("balanced", 0), ("fast", 1), ("balanced", 1), ("quality", 1)]),
       grad=st.none() | st.floats(0, 10, allow_nan=False),
       preset=st.none() | st.sampled_from(list(LORA_TARGET_PRESETS)),
       prompts=st.none() | st.lists(st.text(min_size=1, max_size=40), max_size=4))
def test_no_request_can_produce_a_token_outside_the_allowed_key_value_form(
        dataset, output, model, name, trigger, subject, repeats, seed, tier_device, grad, preset, prompts):
    tier, device = tier_device
    samples = None if prompts is None else tuple({"prompt": p} for p in prompts)
    req = request(dataset_dir=dataset, output_dir=output, base_model_path=model, output_name=name, trigger=trigger,
                  subject_class=subject, repeats=repeats, seed=seed, tier=tier, device_index=device,
                  max_grad_norm=grad, lora_target_modules=preset, samples=samples)
    try:
        made = config(req)
    except DatasetInvalid:  # a quote or control character no TOML literal string holds: refused, said why
        assert any(ch == "'" or (ch != "\t" and unicodedata.category(ch) == "Cc") for ch in dataset + subject)
        return
    argv = build_argv(req, SETTINGS, LOCAL, made)
    argv_is_fixed_shape(argv, SETTINGS)
    # every user-derived value sits inside the token of its own key, whole; the dataset inside the config
    assert f"--dataset_config={made.path}" in argv and f"--output_dir={output}" in argv
    assert f"--pretrained_model_name_or_path={model}" in argv and f"--output_name={name}" in argv
    # a prompt is in the prompts file, never in a token: ` --n …` or a newline in it is text, not an option
    assert len(argv) == len(argv_of(request(max_grad_norm=grad, lora_target_modules=preset,
                                            samples=None if prompts != [] else ())))
    assert tomllib.loads(made.content.decode()) == {"datasets": [{"subsets": [{
        "image_dir": os.path.join(dataset, f"{repeats}_{trigger} {subject}"), "class_tokens": f"{trigger} {subject}",
        "num_repeats": made.presentation.repeats}]}]}


def test_keys_and_flags_of_the_recipe_are_tiers_own():
    # every tier's argv uses the same keys: nothing about a tier adds or removes a flag
    keys = {tuple(t.split("=")[0] for t in argv_of(request(tier=t, device_index=1))) for t in TIERS}
    assert len(keys) == 1


# What sd-scripts saves each --save_precision as (library/train_util.py: None keeps the training dtype, which
# for a LoRA under --mixed_precision=bf16 is float32; the reference run's file is all F32).
SAVED_DTYPE = {None: "F32", "float": "F32", "fp16": "F16", "bf16": "BF16"}


@pytest.mark.parametrize("tier", list(TIERS))
def test_the_trainer_is_told_exactly_what_its_lora_is_held_to(tier):
    req = request(tier=tier, device_index=1)
    tokens = dict(t[2:].split("=", 1) for t in argv_of(req) if t.startswith("--") and "=" in t)
    assert int(tokens["network_dim"]) == req.expected.rank and int(tokens["max_train_steps"]) == req.expected.steps
    assert (tokens["output_name"], int(tokens["seed"])) == (req.expected.output_name, req.expected.seed)
    assert Path(tokens["output_dir"]) / f"{tokens['output_name']}.safetensors" == req.lora_file
    assert SAVED_DTYPE[tokens.get("save_precision")] == req.expected.dtype


# -- step checkpoints ---------------------------------------------------------------------------------------------

def kept_after_each_save(every: int, value: int, saves: int, state: bool) -> list[list[int]]:
    """The step numbers left on disk after each save, by sd-scripts' own arithmetic (train_util.py at 48d368fa:
    get_remove_step_no for step LoRAs, save_and_remove_state_stepwise for states), written out here."""
    present: list[int] = []
    history = []
    for step in range(every, every * saves + 1, every):
        present.append(step)
        remove = step - value - 1
        remove -= remove % every
        if (remove > 0) if state else (remove >= 0):
            present = [s for s in present if s != remove]
        history.append(list(present))
    return history


@pytest.mark.parametrize("every", [2, 3, 150, 400])
@pytest.mark.parametrize("kept", [1, 2, 3])
def test_the_last_n_values_keep_exactly_that_many_saves(every, kept):
    value = keep_last(kept, every)
    for state in (True, False):
        history = kept_after_each_save(every, value, saves=8, state=state)
        assert [len(h) for h in history] == [min(i + 1, kept) for i in range(8)]
        assert history[-1] == [every * s for s in range(9 - kept, 9)]  # the newest ones


def test_keeping_one_of_every_step_is_refused():
    with pytest.raises(ValueError):
        keep_last(1, 1)  # value 1 would remove nothing at all: s - 2 rounded to a multiple of 1 is s - 2


@pytest.mark.parametrize("tier", list(TIERS))
def test_every_tier_saves_and_samples_where_the_last_step_falls_and_keeps_each_sampled_step_lora(tier):
    req = request(tier=tier, device_index=1)
    argv = argv_of(req)
    tokens = dict(t[2:].split("=", 1) for t in argv if t.startswith("--") and "=" in t)
    every = int(tokens["save_every_n_steps"])
    assert "--save_state" in argv and every == SAVE_EVERY_N_STEPS[tier] == int(tokens["sample_every_n_steps"])
    assert 2 <= every < req.expected.steps
    # a pass at the last step draws the final weights: sd-scripts' pass at the end is skipped for step sampling
    assert req.expected.steps % every == 0
    saves = req.expected.steps // every
    loras = kept_after_each_save(every, int(tokens["save_last_n_steps"]), saves=saves, state=False)
    assert loras[-1] == [every * s for s in range(1, saves + 1)]  # every sampled step LoRA, to choose from
    states = kept_after_each_save(every, int(tokens["save_last_n_steps_state"]), saves=saves, state=True)
    assert all(len(h) == 1 for h in states)


def test_the_fixed_argv_is_accepted_by_the_trainers_parser():
    """Every key and flag of the fixed argv is one sd-scripts' parser knows, with a value it takes: the fake's
    parser is a double of sd-scripts' own (tests/fakes; held to the real flag names), and an unknown flag or a bad
    value is argparse's exit 2. With LW_RIG pointing at the real trainer's rig, its own parser is asked too."""
    fake = load_fake_trainer()
    for tier, device in [("fast", 0), ("balanced", 1), ("quality", 1)]:
        argv = argv_of(request(tier=tier, device_index=device))
        script_args = argv[argv.index(str(SETTINGS.train_script)) + 1:]
        args = fake.setup_parser().parse_args(script_args)
        assert args.save_state and args.save_every_n_steps == SAVE_EVERY_N_STEPS[tier]
        assert args.save_last_n_steps_state == 1 and args.sample_at_first and args.sample_sampler == "euler_a"


RIG = os.environ.get("LW_RIG")  # the real trainer's rig (../shared/rig); CI has none


@pytest.mark.slow
@pytest.mark.skipif(not RIG, reason="LW_RIG names no rig of the real trainer")
def test_the_fixed_argv_is_accepted_by_the_real_trainers_parser():
    """sd-scripts' own setup_parser (the pinned commit, in the rig's venv) parses every tier's script args."""
    rig = Path(str(RIG))
    cases, configs = {}, {}
    for tier, device in [("fast", 0), ("balanced", 1), ("quality", 1)]:
        argv = argv_of(request(tier=tier, device_index=device))
        configs[tier] = str(config(request(tier=tier, device_index=device)).path)
        cases[tier] = argv[argv.index(str(SETTINGS.train_script)) + 1:]
    probe = ("import json, sys; import sdxl_train_network as t; cases = json.loads(sys.argv[1]); "
             "out = {k: vars(t.setup_parser().parse_args(v)) for k, v in cases.items()}; "
             "print(json.dumps({k: {n: a[n] for n in ('save_state', 'save_every_n_steps', 'save_last_n_steps', "
             "'save_last_n_steps_state', 'dataset_config', 'train_data_dir', 'sample_every_n_steps', "
             "'sample_at_first', 'sample_sampler')} for k, a in out.items()}, default=str))")
    done = subprocess.run([str(rig / "venv" / "bin" / "python"), "-c", probe, json.dumps(cases)],
                          cwd=rig / "sd-scripts", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    for tier in cases:
        every, steps = SAVE_EVERY_N_STEPS[tier], TIERS[tier].max_train_steps
        assert parsed[tier] == {"save_state": True, "save_every_n_steps": every,
                                "save_last_n_steps": keep_last(min(8, steps // every), every),
                                "save_last_n_steps_state": 1, "dataset_config": configs[tier], "train_data_dir": None,
                                "sample_every_n_steps": every, "sample_at_first": True, "sample_sampler": "euler_a"}

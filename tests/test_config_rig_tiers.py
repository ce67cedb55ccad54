"""`rig_tier_sizes`: a tier shrunk for a run of the real trainer on the CPU rig (tests/rig/), set only by code that
builds Settings itself: refused in a config file, never read from the environment, carried to the supervisor."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_worker.config import TIERS, ConfigError, Settings, load_settings, settings_from_json, settings_to_json
from lora_worker.config_tables import SAMPLE_NEGATIVE_PROMPT, SAMPLE_STEPS, SAVE_EVERY_N_STEPS
from lora_worker.dispatch.argv import build_argv
from lora_worker.dispatch.presentation import config_for
from lora_worker.run.local import LocalBackend
from lora_worker.dispatch.request import TrainRequest, resolve_request
from lora_worker.dispatch.samples import prompts_file

RIG = {"fast": {"max_train_steps": 7, "network_dim": 4, "resolution": 256, "save_every_n_steps": 2,
                "sample_steps": 3}}


def rig_settings(**values: object) -> Settings:
    return Settings(sandbox="none", **values)  # type: ignore[arg-type]


def test_without_it_the_tiers_and_save_intervals_are_config_tables(tmp_path: Path) -> None:
    settings = rig_settings()
    assert settings.tiers is TIERS
    assert {t: settings.save_every_n_steps(t) for t in TIERS} == dict(SAVE_EVERY_N_STEPS)


def test_it_replaces_the_named_tier_only() -> None:
    settings = rig_settings(rig_tier_sizes=RIG)
    fast = settings.tiers["fast"]
    assert (fast.max_train_steps, fast.network_dim, fast.resolution) == (7, 4, 256)
    assert settings.save_every_n_steps("fast") == 2
    assert settings.tiers["balanced"] == TIERS["balanced"] and settings.save_every_n_steps("balanced") == 300
    assert (settings.sample_steps("fast"), settings.sample_steps("balanced")) == (3, SAMPLE_STEPS)


def test_the_argv_and_the_expected_lora_follow_it() -> None:
    settings = rig_settings(rig_tier_sizes=RIG)
    raw = TrainRequest(dataset_dir="/t/t1/dataset", base_model_path="/m/sdxl.safetensors", output_dir="/t/t1/output",
                       output_name="ohwx", trigger="ohwx", subject_class="dog", repeats=3, tier="fast",
                       device_index=0, seed=42)  # type: ignore[call-arg]
    req = resolve_request(raw, train_id="t1", dataset_dir=Path("/t/t1/dataset"),
                          base_model_path=Path("/m/sdxl.safetensors"), output_dir=Path("/t/t1/output"),
                          tiers=settings.tiers)
    argv = build_argv(req, settings, LocalBackend(), config_for(req, settings, LocalBackend(), 3))
    # the 3 sampled step LoRAs (2, 4, 6) kept: (3 - 1) * 2 + 1
    for flag in ("--max_train_steps=7", "--network_dim=4", "--resolution=256", "--save_every_n_steps=2",
                 "--save_last_n_steps=5", "--save_last_n_steps_state=1", "--sample_every_n_steps=2"):
        assert flag in argv, flag
    assert (req.expected.steps, req.expected.rank) == (7, 4)
    found = prompts_file(req.samples, req.tier, settings, LocalBackend())
    assert found is not None and f"--sample_prompts={found.path}" in argv
    assert json.loads(found.data) == [{"prompt": "photo of ohwx dog", "negative_prompt": SAMPLE_NEGATIVE_PROMPT,
                                       "width": 256, "height": 256, "seed": 42, "sample_steps": 3, "scale": 7.0}]


@pytest.mark.parametrize("sizes", [{"turbo": {"max_train_steps": 2}}, {"fast": {"epochs": 2}},
                                   {"fast": {"max_train_steps": 0}}])
def test_an_unknown_tier_key_or_a_size_below_one_is_refused(sizes: dict) -> None:
    with pytest.raises(ConfigError, match="rig_tier_sizes"):
        rig_settings(rig_tier_sizes=sizes)


def test_a_config_file_may_not_set_it(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('sandbox = "none"\n[rig_tier_sizes.fast]\nmax_train_steps = 7\n')
    with pytest.raises(ConfigError, match="refused in a config file"):
        load_settings({"LORA_WORKER_CONFIG": str(config)})


def test_the_environment_does_not_set_it() -> None:
    settings = load_settings({"LORA_WORKER_SANDBOX": "none",
                              "LORA_WORKER_RIG_TIER_SIZES": '{"fast": {"max_train_steps": 7}}'})
    assert settings.tiers is TIERS


def test_the_supervisor_gets_the_same_sizes() -> None:
    again = settings_from_json(settings_to_json(rig_settings(rig_tier_sizes=RIG)))
    assert again.tiers["fast"] == rig_settings(rig_tier_sizes=RIG).tiers["fast"]
    assert again.save_every_n_steps("fast") == 2


def fast_request(settings: Settings, samples: tuple | None = None):  # type: ignore[no-untyped-def]
    raw = TrainRequest(dataset_dir="/t/t1/dataset", base_model_path="/m/sdxl.safetensors", output_dir="/t/t1/output",
                       output_name="ohwx", trigger="ohwx", subject_class="dog", repeats=3, tier="fast",
                       device_index=0, seed=42, samples=samples)  # type: ignore[call-arg]
    return resolve_request(raw, train_id="t1", dataset_dir=Path("/t/t1/dataset"),
                           base_model_path=Path("/m/sdxl.safetensors"), output_dir=Path("/t/t1/output"),
                           tiers=settings.tiers)


def argv_of(settings: Settings, samples: tuple | None = None) -> list[str]:
    req = fast_request(settings, samples)
    return build_argv(req, settings, LocalBackend(), config_for(req, settings, LocalBackend(), 3))


def test_the_gpu_checks_sample_pass_is_a_jobs_own_and_the_rig_sizes_only_shorten_it() -> None:
    """The GPU check's sampled run (bench/gpu_check) asks for its prompt in the request, as any job does: the one
    prompts file and the sample flags of dispatch/samples.py, a pass at the start and at each save, its sampler
    steps the rig's `sample_steps`; its plain run asks for none (`samples: []`) and gets no sample flag. The rig
    sizes add no sample flag of their own, and the supervisor's settings build the same command."""
    settings = rig_settings(rig_tier_sizes={"fast": {**RIG["fast"], "sample_steps": 2}})
    prompt = ({"prompt": "ohwx dog, sitting on grass", "seed": 42},)
    argv = argv_of(settings, prompt)
    found = prompts_file(fast_request(settings, prompt).samples, settings.tiers["fast"], settings, LocalBackend())
    assert found is not None and found.path.parent == settings.state_dir / "prompts"
    assert [t for t in argv if t.startswith("--sample")] == [
        f"--sample_prompts={found.path}", "--sample_every_n_steps=2", "--sample_sampler=euler_a", "--sample_at_first"]
    assert json.loads(found.data) == [{"prompt": "ohwx dog, sitting on grass", "seed": 42, "sample_steps": 2,
                                       "negative_prompt": SAMPLE_NEGATIVE_PROMPT, "width": 256, "height": 256,
                                       "scale": 7.0}]
    assert not [t for t in argv_of(settings, ()) if t.startswith("--sample")]
    again = settings_from_json(settings_to_json(settings))
    assert argv_of(again, prompt) == argv  # the supervisor's command
    with pytest.raises(ConfigError, match="rig_tier_sizes"):  # the GPU check's own interval before issue #33
        rig_settings(rig_tier_sizes={"fast": {**RIG["fast"], "sample_every_n_steps": 3}})


def test_a_config_file_may_not_shorten_the_sample_passes(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('sandbox = "none"\n[rig_tier_sizes.fast]\nsample_steps = 5\n')
    with pytest.raises(ConfigError, match="refused in a config file"):
        load_settings({"LORA_WORKER_CONFIG": str(config)})

"""`rig_tier_sizes`: a tier shrunk for a run of the real trainer on the CPU rig (tests/rig/), set only by code that
builds Settings itself: refused in a config file, never read from the environment, carried to the supervisor."""
from __future__ import annotations

from pathlib import Path

import pytest

from lora_worker.config import TIERS, ConfigError, Settings, load_settings, settings_from_json, settings_to_json
from lora_worker.config_tables import SAVE_EVERY_N_STEPS
from lora_worker.dispatch.argv import build_argv
from lora_worker.dispatch.presentation import config_for
from lora_worker.run.local import LocalBackend
from lora_worker.dispatch.request import TrainRequest, resolve_request

RIG = {"fast": {"max_train_steps": 7, "network_dim": 4, "resolution": 256, "save_every_n_steps": 2}}


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
    assert settings.tiers["balanced"] == TIERS["balanced"] and settings.save_every_n_steps("balanced") == 400


def test_the_argv_and_the_expected_lora_follow_it() -> None:
    settings = rig_settings(rig_tier_sizes=RIG)
    raw = TrainRequest(dataset_dir="/t/t1/dataset", base_model_path="/m/sdxl.safetensors", output_dir="/t/t1/output",
                       output_name="ohwx", trigger="ohwx", subject_class="dog", repeats=3, tier="fast",
                       device_index=0, seed=42)  # type: ignore[call-arg]
    req = resolve_request(raw, train_id="t1", dataset_dir=Path("/t/t1/dataset"),
                          base_model_path=Path("/m/sdxl.safetensors"), output_dir=Path("/t/t1/output"),
                          tiers=settings.tiers)
    argv = build_argv(req, settings, LocalBackend(), config_for(req, settings, LocalBackend(), 3))
    for flag in ("--max_train_steps=7", "--network_dim=4", "--resolution=256", "--save_every_n_steps=2",
                 "--save_last_n_steps=1", "--save_last_n_steps_state=1"):
        assert flag in argv, flag
    assert (req.expected.steps, req.expected.rank) == (7, 4)


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


def fast_request(settings: Settings):  # type: ignore[no-untyped-def]
    raw = TrainRequest(dataset_dir="/t/t1/dataset", base_model_path="/m/sdxl.safetensors", output_dir="/t/t1/output",
                       output_name="ohwx", trigger="ohwx", subject_class="dog", repeats=3, tier="fast",
                       device_index=0, seed=42)  # type: ignore[call-arg]
    return resolve_request(raw, train_id="t1", dataset_dir=Path("/t/t1/dataset"),
                           base_model_path=Path("/m/sdxl.safetensors"), output_dir=Path("/t/t1/output"),
                           tiers=settings.tiers)


def presented(settings: Settings):  # type: ignore[no-untyped-def]
    return config_for(fast_request(settings), settings, LocalBackend(), 3)


def test_a_sample_pass_only_for_a_tier_whose_rig_sizes_name_one() -> None:
    """The GPU check's sample pass (bench/gpu_check): the prompts file in the job's output dir, at the start and
    every N steps; no other tier, and no worker without rig sizes, gets a sample flag."""
    sampled = rig_settings(rig_tier_sizes={"fast": {**RIG["fast"], "sample_every_n_steps": 3}})
    argv = build_argv(fast_request(sampled), sampled, LocalBackend(), presented(sampled))
    assert argv[-3:] == ["--sample_prompts=/t/t1/output/sample-prompts.txt", "--sample_every_n_steps=3",
                         "--sample_at_first"]
    for settings in (rig_settings(), rig_settings(rig_tier_sizes=RIG)):
        assert not [t for t in build_argv(fast_request(settings), settings, LocalBackend(), presented(settings))
                    if t.startswith("--sample")]
    assert sampled.sample_every_n_steps("balanced") is None and rig_settings().sample_every_n_steps("fast") is None
    again = settings_from_json(settings_to_json(sampled))
    assert build_argv(fast_request(again), again, LocalBackend(), presented(again)) == argv  # the supervisor's command


def test_a_config_file_may_not_ask_for_a_sample_pass(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('sandbox = "none"\n[rig_tier_sizes.fast]\nsample_every_n_steps = 5\n')
    with pytest.raises(ConfigError, match="refused in a config file"):
        load_settings({"LORA_WORKER_CONFIG": str(config)})

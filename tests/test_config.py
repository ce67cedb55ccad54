"""Settings: defaults, a TOML file, env overrides, and refusal of anything an operator mistyped."""
from __future__ import annotations

from pathlib import Path

import pytest

from lora_worker.config import (DEFAULT_DEVICES, REPO_ROOT, SDXL_HPARAMS, TIERS, Settings, load_settings,
                                settings_from_json, settings_to_json)
from lora_worker.errors import ConfigError


def test_tiers_and_hyperparameters_are_the_audited_constants():
    assert {n: (t.max_train_steps, t.network_dim, t.resolution) for n, t in TIERS.items()} == {
        "fast": (400, 16, 768), "balanced": (1500, 32, 768), "quality": (3000, 32, 1024)}
    assert (SDXL_HPARAMS["learning_rate"], SDXL_HPARAMS["lr_scheduler"], SDXL_HPARAMS["optimizer_type"],
            SDXL_HPARAMS["min_snr_gamma"], SDXL_HPARAMS["noise_offset"]) == ("1e-4", "cosine", "AdamW8bit", "5", "0.1")


def test_default_devices_are_the_documented_host():
    lean, full = DEFAULT_DEVICES[0], DEFAULT_DEVICES[1]
    assert (lean.train_batch_size, "quality" in lean.tiers) == (1, False)
    assert (full.train_batch_size, full.tiers) == (2, frozenset(TIERS))


def test_defaults_keep_state_under_the_repository(monkeypatch):
    settings = load_settings({})
    assert settings.state_dir == REPO_ROOT / "var"
    assert settings.train_root == Path("/worktank/arbo/train")
    assert settings.database_path == REPO_ROOT / "var" / "ledger.sqlite3"


def test_toml_file_then_env_overrides(tmp_path):
    config = tmp_path / "worker.toml"
    config.write_text('state_dir = "/var/lib/lora-worker"\ncpu_threads = 8\nmodel_dirs = ["/a", "/b"]\n'
                      '[devices.0]\nlabel = "small"\ntiers = ["fast"]\ntrain_batch_size = 1\n'
                      'vram_mib = { fast = 9000 }\n[stall_limits_s]\ntraining = 60\n')
    settings = load_settings({"LORA_WORKER_CONFIG": str(config), "LORA_WORKER_CPU_THREADS": "2",
                              "LORA_WORKER_ALLOW_COTENANCY": "yes"})
    assert settings.state_dir == Path("/var/lib/lora-worker")
    assert settings.cpu_threads == 2  # env wins over the file
    assert settings.model_dirs == (Path("/a"), Path("/b"))
    assert settings.allow_cotenancy is True
    assert list(settings.devices) == [0] and settings.devices[0].vram_mib["fast"] == 9000
    assert settings.stall_limits_s["training"] == 60.0 and settings.stall_limits_s["loading_model"] == 1200.0


@pytest.mark.parametrize("text, message", [
    ("stat_dir = '/x'\n", "unknown setting"),
    ("[devices.1]\nlabel='x'\ntiers=['ultra']\ntrain_batch_size=1\nvram_mib={ultra=1}\n", "unknown tier"),
    ("[devices.1]\nlabel='x'\ntiers=['fast']\ntrain_batch_size=1\n", "vram_mib missing"),
    ("cpu_threads = 'many'\n", "cpu_threads"),
    ("[stall_limits_s]\ntrainig = 60\n", "unknown key.*trainig"),
    ("[disk_mib]\nultra = 10\n", "unknown key.*ultra"),
    ("this is not toml", "cannot read"),
])
def test_a_mistyped_config_stops_the_service(tmp_path, text, message):
    config = tmp_path / "worker.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings({"LORA_WORKER_CONFIG": str(config)})


def test_settings_cross_to_the_supervisor_unchanged(tmp_path):
    settings = Settings(state_dir=tmp_path, cancel_grace_s=3.5, nvml_fake_file=tmp_path / "g.json")
    assert settings_from_json(settings_to_json(settings)) == settings

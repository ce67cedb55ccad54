"""The Slurm settings: defaults, env overrides (tables as JSON), validation when backend = "slurm"."""
from __future__ import annotations

import pytest

from lora_worker.config import TIERS, Settings, load_settings, settings_from_json, settings_to_json
from lora_worker.errors import ConfigError


def test_defaults_are_local_with_slurm_settings_ready():
    s = Settings()
    assert (s.backend, s.max_active_jobs, s.slurm_partition, s.slurm_poll_interval_s) == ("local", 8, "gpu", 2.0)
    assert s.slurm_logs == s.state_dir / "slurm" and s.slurm_bin_dir is None
    # time limits grow with the tier's steps; every tier has a memory limit
    minutes = [s.slurm_time_limit_min[t] for t in ("fast", "balanced", "quality")]
    assert minutes == sorted(minutes) and minutes[0] > TIERS["fast"].max_train_steps * 3 / 60
    assert set(s.slurm_mem_mb) == set(TIERS)


def test_env_overrides_each_slurm_setting():
    s = load_settings({"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_MAX_ACTIVE_JOBS": "3",
                       "LORA_WORKER_SLURM_PARTITION": "a100", "LORA_WORKER_SLURM_LOG_DIR": "/shared/lw",
                       "LORA_WORKER_SLURM_BIN_DIR": "/opt/slurm/bin", "LORA_WORKER_SLURM_POLL_INTERVAL_S": "0.5",
                       "LORA_WORKER_SLURM_MEM_MB": '{"quality": 48000}',
                       "LORA_WORKER_SLURM_TIME_LIMIT_MIN": '{"fast": 20}'})
    assert (s.backend, s.max_active_jobs, s.slurm_partition, str(s.slurm_logs), str(s.slurm_bin_dir)) == (
        "slurm", 3, "a100", "/shared/lw", "/opt/slurm/bin")
    assert (s.slurm_poll_interval_s, s.slurm_mem_mb["quality"], s.slurm_time_limit_min["fast"]) == (0.5, 48000, 20)
    assert s.slurm_mem_mb["fast"] == Settings().slurm_mem_mb["fast"]  # the others keep their defaults
    assert settings_from_json(settings_to_json(s)) == s  # what the poller process receives


@pytest.mark.parametrize("env", [
    {"LORA_WORKER_BACKEND": "kubernetes"},
    {"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_MAX_ACTIVE_JOBS": "0"},
    {"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_SLURM_PARTITION": ""},
    {"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_SLURM_POLL_INTERVAL_S": "0"},
    {"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_SLURM_MEM_MB": '{"quality": 0}'},
    {"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_SLURM_MEM_MB": '{"qualty": 4000}'},
    {"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_SLURM_TIME_LIMIT_MIN": "[1]"},
])
def test_a_bad_slurm_setting_stops_the_worker(env):
    with pytest.raises(ConfigError):
        load_settings(env)

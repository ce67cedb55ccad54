"""`lora-worker doctor` fails when the API token file can be read by every user on the host (the installer's,
beside the config file, or api_token_file), and says how to fix it."""
from __future__ import annotations

from dataclasses import replace

from lora_worker.ops.doctor import run_checks


def token_lines(settings, nvml):
    return [c for c in run_checks(settings, nvml) if c.name == "api token"]


def test_a_token_beside_the_config_that_others_can_read_fails_doctor(migrated, nvml, tmp_path, monkeypatch):
    config = tmp_path / "etc" / "worker.toml"
    config.parent.mkdir()
    config.write_text("")
    token = config.parent / "api_token"
    token.write_text("x" * 40 + "\n")
    monkeypatch.setenv("LORA_WORKER_CONFIG", str(config))
    token.chmod(0o644)
    (check,) = token_lines(migrated, nvml)
    assert not check.ok and check.required
    assert "readable by every user" in check.detail and f"chmod 0600 {token}" in check.detail
    token.chmod(0o640)  # the group is the service's own: fine
    (check,) = token_lines(migrated, nvml)
    assert check.ok, check.line()


def test_an_api_token_file_that_others_can_read_fails_doctor_and_none_says_nothing(migrated, nvml, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.delenv("LORA_WORKER_CONFIG", raising=False)
    assert token_lines(migrated, nvml) == []  # no token: a development server, nothing to say
    token = tmp_path / "token"
    token.write_text("x" * 40 + "\n")
    token.chmod(0o604)
    (check,) = token_lines(replace(migrated, api_token_file=token), nvml)
    assert not check.ok and str(token) in check.detail
    token.unlink()
    token.symlink_to(tmp_path / "elsewhere")
    (check,) = token_lines(replace(migrated, api_token_file=token), nvml)
    assert not check.ok and "not a regular file" in check.detail

"""systemd/install.py against a temporary root: a second run changes nothing, an operator's config and token
are never overwritten, the code is mirrored, and the health gate waits for a real 200."""
from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from lora_worker.config import REPO_ROOT, load_settings
from tests.helpers import install_script
from tests.helpers.deploy import locked_pins
from tests.helpers.service import Service, free_port
from tests.helpers.deploy import copy_of, install, snapshot

# Each install builds a venv from the lock: ~1 min quiet, past the suite's 120 s timeout on a loaded machine; the
# install helper itself allows 600 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_second_install_into_the_same_root_changes_nothing(staged):
    root, first, second, after_first = staged
    assert "change(s)" in first and not first.startswith("0 change")
    assert "0 change(s): everything was already in place" in second and "changed:" not in second
    assert snapshot(root) == after_first


def test_the_install_lays_out_the_documented_host(staged):
    root = staged[0]
    train_root = root / "worktank/arbo/train"
    assert train_root.is_dir() and stat.S_IMODE(train_root.stat().st_mode) == 0o2770  # setgid, group only
    config, token = root / "etc/lora-worker/worker.toml", root / "etc/lora-worker/api_token"
    assert stat.S_IMODE(config.stat().st_mode) == 0o640 and stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_bytes().strip()) >= 32
    settings = load_settings({"LORA_WORKER_CONFIG": str(config)})  # every key is a real setting
    assert (settings.bind, str(settings.state_dir), str(settings.train_root), str(settings.gpu_lock_dir)) == (
        "0.0.0.0:8203", "/var/lib/lora-worker", "/worktank/arbo/train", "/run/lock/gpu")
    assert (settings.gpu_lock_group, settings.gpu_lock_everyone, settings.arbo_user) == ("arbotrain", False, "lkraven")
    assert str(settings.accelerate) == "/opt/fluxgym/.venv/bin/accelerate"  # the seed's trainer venv
    assert settings.api_token_file is None  # the token travels as a systemd credential
    script = install_script()
    unit = root / "etc/systemd/system/lora-worker.service"
    for name in ("lora-worker.service", "lora-worker-check.service", "lora-worker-check.timer"):  # + daily check
        installed = root / "etc/systemd/system" / name
        assert installed.read_text() == script.render((REPO_ROOT / f"systemd/{name}.in").read_text(),
                                                      script.Identities()), name
        assert stat.S_IMODE(installed.stat().st_mode) == 0o644, name
    assert "User=llmuser" in unit.read_text() and "SupplementaryGroups=arbotrain" in unit.read_text()
    tmpfiles = (root / "etc/tmpfiles.d/lora-worker.conf").read_text()
    assert "d /run/lock/gpu 3770 root arbotrain -" in tmpfiles.splitlines()
    command = root / "usr/local/bin/lora-worker"
    assert stat.S_IMODE(command.stat().st_mode) == 0o755
    assert "LORA_WORKER_CONFIG=/etc/lora-worker/worker.toml" in command.read_text()
    assert "runuser -u llmuser" in command.read_text()
    for rel in ("lora_worker/web/app.py", "migrations/versions/0003_operator_views.py", "systemd/gunicorn.conf.py"):
        assert (root / "opt/lora-training-worker" / rel).read_bytes() == (REPO_ROOT / rel).read_bytes()
    assert (root / "opt/lora-training-worker/venv/bin/lora-worker").exists()  # the editable install's entry point


def test_the_installed_venv_runs_the_installed_code_and_finds_its_migrations(staged):
    root = staged[0]
    python = root / "opt/lora-training-worker/venv/bin/python"
    # migrate.py finds migrations/ at REPO_ROOT, so REPO_ROOT must be the install dir, not site-packages; the
    # app imports, so the lock held every package it needs.
    code = "import lora_worker.config as c, lora_worker.web.app; print(c.REPO_ROOT / 'migrations')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, env=env,
                            cwd=root)  # not the checkout: its lora_worker/ would be found first
    assert result.stdout.strip() == str(root / "opt/lora-training-worker/migrations")
    assert (root / "opt/lora-training-worker/migrations/env.py").is_file()
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, env=env)
    assert check.returncode == 0, check.stdout


def test_the_venv_holds_exactly_the_locked_versions(staged):
    python = staged[0] / "opt/lora-training-worker/venv/bin/python"
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                            check=True).stdout
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listed)}
    locked = locked_pins()
    assert {name: installed.get(name) for name in locked} == locked
    assert set(installed) - set(locked) == {"pip", "lora-worker"}  # nothing came in beside the lock and the worker


def test_an_existing_config_and_token_are_never_overwritten(staged, tmp_path):
    root = copy_of(staged[0], tmp_path)
    config, token = root / "etc/lora-worker/worker.toml", root / "etc/lora-worker/api_token"
    config.write_text('bind = "10.0.0.5:8203"\n')
    token.write_text("an-operator-chosen-token-of-40-bytes-xxxx\n")
    token.chmod(0o644)
    out = install(root).stdout
    assert config.read_text() == 'bind = "10.0.0.5:8203"\n'
    assert token.read_text() == "an-operator-chosen-token-of-40-bytes-xxxx\n"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600  # its mode is still made safe
    assert "kept: /etc/lora-worker/worker.toml (exists)" in out and "kept: /etc/lora-worker/api_token (exists)" in out


def test_the_code_is_mirrored_stale_files_removed_and_edits_undone(staged, tmp_path):
    root = copy_of(staged[0], tmp_path)
    code = root / "opt/lora-training-worker"
    (code / "lora_worker/removed_module.py").write_text("x = 1\n")
    (code / "lora_worker/web/app.py").write_text("tampered\n")
    out = install(root).stdout
    assert not (code / "lora_worker/removed_module.py").exists()
    assert (code / "lora_worker/web/app.py").read_bytes() == (REPO_ROOT / "lora_worker/web/app.py").read_bytes()
    assert "removed /opt/lora-training-worker/lora_worker/removed_module.py" in out and "3 change(s)" in out
    assert "changed: compiled 1 module(s) to byte code" in out  # app.py, rewritten
    assert (code / "venv/bin/python").exists()  # the venv beside the code is not a stale code file


def test_the_health_gate_passes_on_200_and_fails_without_an_answer(migrated, host):
    script = install_script()
    service = Service(migrated, host.root / "gunicorn.log").start()
    try:
        assert script.health_gate(f"{service.url}/healthz", timeout_s=10) is True
    finally:
        service.stop()
    assert script.health_gate(f"http://127.0.0.1:{free_port()}/healthz", timeout_s=1.0) is False

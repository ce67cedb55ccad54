"""The shipped unit and gunicorn settings: training survives restarts, CUDA keeps working, paths line up with
the deployed config, and systemd itself accepts the unit."""
from __future__ import annotations

import runpy
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from lora_worker.config import REPO_ROOT
from tests.helpers import install_script

UNIT = REPO_ROOT / "systemd" / "lora-worker.service"
TMPFILES = REPO_ROOT / "systemd" / "lora-worker.tmpfiles.conf"
GUNICORN_CONF = REPO_ROOT / "systemd" / "gunicorn.conf.py"


def directives(path: Path) -> dict[str, list[str]]:
    """`Key=value` lines, every value of a repeated key in order (ExecStartPre=…)."""
    found: dict[str, list[str]] = defaultdict(list)
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found[key.strip()].append(value.strip())
    return found


def deployed_config() -> dict[str, object]:
    return install_script().WORKER_TOML


def test_a_restart_of_the_unit_never_kills_training():
    unit = directives(UNIT)
    assert unit["KillMode"] == ["process"]  # only the gunicorn master is signalled
    assert "RuntimeDirectory" not in unit  # removed on stop: live supervisors' locks would vanish
    assert unit["StateDirectory"] == ["lora-worker"]
    text = UNIT.read_text()
    assert "systemctl stop lora-worker` does NOT stop training" in text and "jobs cancel --all" in text


def test_the_unit_migrates_and_reconciles_before_serving_gunicorn_with_the_shipped_settings():
    unit = directives(UNIT)
    assert unit["ExecStartPre"] == ["/opt/lora-worker/venv/bin/lora-worker migrate",
                                    "/opt/lora-worker/venv/bin/lora-worker reconcile"]
    assert unit["ExecStart"] == ["/opt/lora-worker/venv/bin/gunicorn -c /opt/lora-worker/systemd/gunicorn.conf.py "
                                 "lora_worker.wsgi:app"]
    assert unit["Environment"] == ["LORA_WORKER_CONFIG=/etc/lora-worker/worker.toml", "LORA_WORKER_SANDBOX=bwrap"]
    assert unit["LoadCredential"] == ["api_token:/etc/lora-worker/api_token"]


def test_the_unit_runs_unprivileged_with_the_hardening_that_keeps_cuda_working():
    unit = directives(UNIT)
    assert unit["User"] == ["lora-worker"] and unit["SupplementaryGroups"] == ["arbo"]
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("PrivateTmp", "yes")):
        assert unit[key] == [value], key
    assert "PrivateDevices" not in unit  # it hides /dev/nvidia*
    assert "MemoryDenyWriteExecute" not in unit  # it breaks CUDA's and PyTorch's JIT


def test_the_unit_can_write_exactly_where_the_deployed_config_points():
    config = deployed_config()
    writable = set(" ".join(directives(UNIT)["ReadWritePaths"]).split())
    assert writable == {config["train_root"], config["gpu_lock_dir"]}
    assert config["state_dir"] == "/var/lib/" + directives(UNIT)["StateDirectory"][0]
    (entry,) = [line.split() for line in TMPFILES.read_text().splitlines() if line and not line.startswith("#")]
    assert entry[:2] == ["d", config["gpu_lock_dir"]]  # /run is a tmpfs: the lock dir is made at boot


def test_gunicorn_is_one_gthread_worker_without_preload_that_stops_before_systemd_kills_it(monkeypatch):
    monkeypatch.setenv("LORA_WORKER_BIND", "127.0.0.1:1,[::1]:2")
    conf = runpy.run_path(str(GUNICORN_CONF))
    assert (conf["workers"], conf["worker_class"], conf["preload_app"]) == (
        1, "lora_worker.web.buffered_worker.BufferingThreadWorker", False)  # gthread, buffering whole requests
    assert conf["threads"] >= 4  # a slow client never holds the only thread a cancel needs
    assert conf["bind"] == ["127.0.0.1:1", "[::1]:2"]  # the `bind` setting
    assert conf["graceful_timeout"] < int(directives(UNIT)["TimeoutStopSec"][0].rstrip("s"))
    assert "}i" not in conf["access_log_format"]  # %({header}i)s would log request headers: the token
    assert conf["control_socket_disable"] is True


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_every_line_of_the_unit(tmp_path):
    result = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    # The only complaint allowed is that the venv is not installed on this machine.
    assert all("/opt/lora-worker/venv/bin/" in line and "is not executable" in line for line in complaints), complaints

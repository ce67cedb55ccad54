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

GUNICORN_CONF = REPO_ROOT / "systemd" / "gunicorn.conf.py"


def rendered(name: str, tmp_dir: Path | None = None, **identities: object) -> Path | str:
    """A template of systemd/ as install.py fills it in (the seed's identities unless told otherwise)."""
    script = install_script()
    text = script.render((REPO_ROOT / "systemd" / f"{name}.in").read_text(), script.Identities(**identities))
    if tmp_dir is None:
        return text
    path = tmp_dir / name
    path.write_text(text)
    return path


UNIT = "lora-worker.service"
TMPFILES = "lora-worker.tmpfiles.conf"


def directives(name: str, **identities: object) -> dict[str, list[str]]:
    """`Key=value` lines, every value of a repeated key in order (ExecStartPre=…)."""
    found: dict[str, list[str]] = defaultdict(list)
    for line in str(rendered(name, **identities)).splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found[key.strip()].append(value.strip())
    return found


def deployed_config() -> dict[str, object]:
    script = install_script()
    return script.worker_toml(script.Identities())


def test_a_restart_of_the_unit_never_kills_training():
    unit = directives(UNIT)
    assert unit["KillMode"] == ["process"]  # only the gunicorn master is signalled
    assert "RuntimeDirectory" not in unit  # removed on stop: live supervisors' locks would vanish
    assert unit["StateDirectory"] == ["lora-worker"]
    text = str(rendered(UNIT))
    assert "systemctl stop lora-worker` does NOT stop training" in text and "jobs cancel --all" in text


def test_the_unit_migrates_and_reconciles_before_serving_gunicorn_with_the_shipped_settings():
    unit = directives(UNIT)
    assert unit["ExecStartPre"] == ["/opt/lora-training-worker/venv/bin/lora-worker migrate",
                                    "/opt/lora-training-worker/venv/bin/lora-worker reconcile"]
    assert unit["ExecStart"] == ["/opt/lora-training-worker/venv/bin/gunicorn -c "
                                 "/opt/lora-training-worker/systemd/gunicorn.conf.py lora_worker.wsgi:app"]
    assert unit["Environment"] == ["LORA_WORKER_CONFIG=/etc/lora-worker/worker.toml", "LORA_WORKER_SANDBOX=bwrap"]
    assert unit["LoadCredential"] == ["api_token:/etc/lora-worker/api_token"]


def test_the_unit_runs_unprivileged_with_the_hardening_that_keeps_cuda_working():
    unit = directives(UNIT)
    assert unit["User"] == ["llmuser"] and unit["SupplementaryGroups"] == ["arbotrain"]  # the seed's identities
    assert "Group" not in unit  # the service user's own primary group
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
    (entry,) = [line.split() for line in str(rendered(TMPFILES)).splitlines() if line and not line.startswith("#")]
    assert entry[:2] == ["d", config["gpu_lock_dir"]]  # /run is a tmpfs: the lock dir is made at boot
    assert directives(UNIT)["RequiresMountsFor"] == [config["train_root"]]


def test_other_identities_fill_every_place_the_seeds_names_stood():
    ids = dict(service_user="svc", group="shared", prefix=Path("/srv/lw"), train_root=Path("/data/train"),
               gpu_lock_dir=Path("/run/lock/gpus"), gpu_lock_group="gpuusers")
    unit = directives(UNIT, **ids)
    assert (unit["User"], unit["SupplementaryGroups"], unit["WorkingDirectory"]) == (
        ["svc"], ["shared gpuusers"], ["/srv/lw"])
    assert unit["ReadWritePaths"] == ["/data/train /run/lock/gpus"]
    text = str(rendered(UNIT, **ids)) + str(rendered(TMPFILES, **ids))
    for seed_name in ("llmuser", "arbotrain", "/opt/lora-training-worker", "/worktank", "/run/lock/gpu "):
        assert seed_name not in text, seed_name
    assert "d /run/lock/gpus 3770 root gpuusers -" in text


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
    result = subprocess.run(["systemd-analyze", "verify", str(rendered(UNIT, tmp_path))], capture_output=True,
                            text=True)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    # The only complaint allowed is that the venv is not installed on this machine.
    assert all("/opt/lora-training-worker/venv/bin/" in line and "is not executable" in line
               for line in complaints), complaints

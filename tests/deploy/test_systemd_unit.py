"""The shipped units and gunicorn settings: training survives restarts, CUDA keeps working, paths line up with
the deployed config, the ledger's full check runs daily off the start path, and systemd itself accepts them."""
from __future__ import annotations

import runpy
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from lora_worker.config import REPO_ROOT
from lora_worker.ops import cli
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
CHECK_UNIT = "lora-worker-check.service"
CHECK_TIMER = "lora-worker-check.timer"


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


def test_a_daily_timer_runs_the_full_ledger_check_and_a_failure_fails_the_unit():
    timer = directives(CHECK_TIMER)
    assert timer["OnCalendar"] == ["daily"] and timer["Persistent"] == ["true"]  # a day missed is made up at boot
    assert timer["RandomizedDelaySec"] == ["1h"] and timer["WantedBy"] == ["timers.target"]
    assert "Unit" not in timer  # it starts the service of its own name
    check = directives(CHECK_UNIT)
    assert check["Type"] == ["oneshot"]
    # No "-" prefix and no SuccessExitStatus=: exit 1 leaves the unit failed (`systemctl --failed`).
    assert check["ExecStart"] == ["/opt/lora-training-worker/venv/bin/lora-worker check-ledger"]
    assert "SuccessExitStatus" not in check
    argv = check["ExecStart"][0].split()[1:]
    assert cli.build_parser().parse_args(argv).command == "check-ledger"  # a command the CLI has
    assert cli.COMMANDS["check-ledger"] is cli.cmd_check_ledger


def test_the_ledger_check_runs_as_the_service_at_idle_priority_without_its_credentials():
    unit, check = directives(UNIT), directives(CHECK_UNIT)
    for key in ("User", "UMask", "WorkingDirectory", "StateDirectory", "StateDirectoryMode", "NoNewPrivileges",
                "ProtectSystem", "ProtectHome", "PrivateTmp"):
        assert check[key] == unit[key], key
    assert check["Environment"] == ["LORA_WORKER_CONFIG=/etc/lora-worker/worker.toml"]  # the same ledger path
    assert "LoadCredential" not in check  # it needs no API token
    assert check["Nice"] == ["19"] and check["IOSchedulingClass"] == ["idle"]
    assert check["PrivateNetwork"] == ["yes"] and check["PrivateDevices"] == ["yes"]  # no trainer, no GPU here


def test_the_installer_enables_and_starts_the_check_timer_beside_the_service(monkeypatch, capsys):
    script = install_script()
    ran: list[list[str]] = []
    monkeypatch.setattr(script.Installer, "command", lambda self, argv, what, **kw: ran.append(argv))
    script.Installer(Path("/"), script.Identities(), systemctl=True, accounts=False, pip_args=[]).start_service()
    assert ["systemctl", "enable", "--now", "lora-worker-check.timer"] in ran
    assert ran.index(["systemctl", "daemon-reload"]) < ran.index(["systemctl", "enable", "--now",
                                                                   "lora-worker-check.timer"])
    assert (script.CHECK_UNIT.name, script.CHECK_TIMER.name) == (CHECK_UNIT, CHECK_TIMER)


def test_other_identities_fill_every_place_the_seeds_names_stood():
    ids = dict(service_user="svc", group="shared", prefix=Path("/srv/lw"), train_root=Path("/data/train"),
               gpu_lock_dir=Path("/run/lock/gpus"), gpu_lock_group="gpuusers")
    unit = directives(UNIT, **ids)
    assert (unit["User"], unit["SupplementaryGroups"], unit["WorkingDirectory"]) == (
        ["svc"], ["shared gpuusers"], ["/srv/lw"])
    assert unit["ReadWritePaths"] == ["/data/train /run/lock/gpus"]
    check = directives(CHECK_UNIT, **ids)
    assert (check["User"], check["ExecStart"]) == (["svc"], ["/srv/lw/venv/bin/lora-worker check-ledger"])
    text = "".join(str(rendered(name, **ids)) for name in (UNIT, TMPFILES, CHECK_UNIT, CHECK_TIMER))
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
@pytest.mark.slow
def test_systemd_accepts_every_line_of_the_units(tmp_path):
    # The timer is verified with its service beside it: systemd checks that the unit it starts exists.
    paths = [str(rendered(name, tmp_path)) for name in (UNIT, CHECK_UNIT, CHECK_TIMER)]
    result = subprocess.run(["systemd-analyze", "verify", *paths], capture_output=True, text=True)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    # The only complaint allowed is that the venv is not installed on this machine.
    assert all("/opt/lora-training-worker/venv/bin/" in line and "is not executable" in line
               for line in complaints), complaints

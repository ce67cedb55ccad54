"""The sender's own unit: run in place by systemd, restarted always, the secret a credential, installed and
enabled beside the service; its cgroup ends it, and the web starts no sender of its own there."""
from __future__ import annotations

import sys
from pathlib import Path

from lora_worker.config import REPO_ROOT
from lora_worker.webhooks import process
from lora_worker.webhooks.__main__ import USAGE
from lora_worker.webhooks.signing import CREDENTIAL
from tests.helpers import install_script


def directives(name: str) -> dict[str, list[str]]:
    script = install_script()
    text = script.render((REPO_ROOT / "systemd" / f"{name}.in").read_text(), script.Identities())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_the_sender_runs_in_place_under_its_own_unit_restarted_always_as_the_service_user():
    unit, service = directives("lora-worker-webhooks.service"), directives("lora-worker.service")
    (exec_start,) = unit["ExecStart"]
    assert exec_start.split()[1:] == ["-m", "lora_worker.webhooks", "--foreground"] and "--foreground" in USAGE
    assert exec_start.split()[0].startswith(service["WorkingDirectory"][0] + "/venv/bin/")
    assert unit["Restart"] == ["always"] and unit["Type"] == ["simple"]
    for key in ("User", "UMask", "Environment", "StateDirectory", "WorkingDirectory"):
        assert unit[key][:1] == service[key][:1], key  # the same user, config and ledger as the web
    assert unit["LoadCredential"] == [f"{CREDENTIAL}:/etc/lora-worker/webhook_secret"]
    assert unit["ConditionPathExists"] == ["/etc/lora-worker/webhook_secret"]  # off until a secret exists


def test_the_installer_installs_and_enables_the_sender(monkeypatch):
    script = install_script()
    assert Path("/etc/systemd/system/lora-worker-webhooks.service") == script.WEBHOOKS_UNIT
    ran: list[list[str]] = []
    monkeypatch.setattr(script.Installer, "command", lambda self, argv, what, **kw: ran.append(argv))
    script.Installer(Path("/"), script.Identities(), systemctl=True, accounts=False, pip_args=[]).start_service()
    assert ["systemctl", "enable", "lora-worker-webhooks.service"] in ran
    assert ran.index(["systemctl", "daemon-reload"]) < ran.index(["systemctl", "enable",
                                                                   "lora-worker-webhooks.service"])


def test_the_units_cgroup_ends_the_sender_and_the_web_starts_none_under_systemd(hooked, monkeypatch):
    unit = directives("lora-worker-webhooks.service")
    assert unit.get("KillMode", ["control-group"]) == ["control-group"]  # a stop ends every process of the unit
    started: list[list[str]] = []
    monkeypatch.setattr(process, "start_detached", lambda argv, env, **kw: started.append(argv))
    monkeypatch.setenv(process.SYSTEMD_ENV, "5f1c")  # the web under lora-worker.service
    process.ensure_sender(hooked)
    assert started == []  # a sender it started would live in the web's unit, outside the sender's
    monkeypatch.delenv(process.SYSTEMD_ENV)
    process.ensure_sender(hooked)  # a checkout: the web starts one
    assert started == [[sys.executable, "-m", "lora_worker.webhooks"]]

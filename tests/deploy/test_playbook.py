"""deploy/lora-worker.yml: valid for ansible-playbook, thin (it drives systemd/install.py with every identity
flag, the seed's values by default) and ending with a health gate on GET /healthz."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import install_script
from tests.helpers.deploy import ANSIBLE, PLAYBOOK



def play() -> dict:
    (document,) = yaml.safe_load(PLAYBOOK.read_text())
    return document


def install_task() -> dict:
    (task,) = [t for t in play()["tasks"] if "lora_worker_install_argv" in t.get("vars", {})]
    return task


@pytest.mark.skipif(not Path(ANSIBLE).exists(), reason="ansible-playbook is not installed (pip: ansible-core, "
                                                        "in the test extras)")
@pytest.mark.slow
def test_ansible_playbook_accepts_the_playbook(tmp_path):
    env = {**os.environ, "ANSIBLE_HOME": str(tmp_path), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
           "ANSIBLE_NOCOLOR": "1"}
    result = subprocess.run([ANSIBLE, "--syntax-check", "-i", "gpu-host,", "-e", "lora_worker_hosts=all",
                             str(PLAYBOOK)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    listed = subprocess.run([ANSIBLE, "--list-tasks", "-i", "gpu-host,", "-e", "lora_worker_hosts=all",
                             str(PLAYBOOK)], capture_output=True, text=True, env=env, timeout=120)
    assert listed.returncode == 0 and "Health gate" in listed.stdout, listed.stdout + listed.stderr


def test_the_playbook_passes_every_identity_flag_the_installer_has():
    group = next(g for g in install_script().build_parser()._action_groups if g.title.startswith("identities"))
    flags = {action.option_strings[0] for action in group._group_actions}
    argv = install_task()["vars"]["lora_worker_install_argv"]
    passed = {arg.split("=")[0] for arg in argv if arg.startswith("--")}
    passed |= {"--gpu-lock-everyone"} if "'--gpu-lock-everyone'" in install_task()["ansible.builtin.command"]["argv"] \
        else set()
    assert flags <= passed, flags - passed
    assert argv[:2] == ["python3", "systemd/install.py"]


def test_the_playbooks_defaults_are_the_seeds_and_the_installers():
    defaults = install_script().Identities()
    variables = play()["vars"]
    assert (variables["lora_worker_service_user"], variables["lora_worker_group"], variables["lora_worker_arbo_user"],
            variables["lora_worker_arbo_uid"]) == ("llmuser", "arbotrain", "lkraven", 1000)
    assert (variables["lora_worker_service_user"], variables["lora_worker_group"], variables["lora_worker_arbo_user"],
            variables["lora_worker_arbo_uid"]) == (defaults.service_user, defaults.group, defaults.arbo_user,
                                                   defaults.arbo_uid)
    for name, value in (("prefix", defaults.prefix), ("train_root", defaults.train_root),
                        ("trainer_venv", defaults.trainer_venv), ("gpu_lock_dir", defaults.gpu_lock_dir)):
        assert variables[f"lora_worker_{name}"] == str(value), name


def test_the_playbook_ends_with_a_health_gate_and_reports_a_change_only_when_the_installer_made_one():
    last = [task for task in play()["tasks"] if "ansible.builtin.uri" in task][-1]
    assert last["ansible.builtin.uri"]["url"] == "{{ lora_worker_health_url }}"
    assert last["ansible.builtin.uri"]["status_code"] == 200 and last["retries"] >= 10
    assert play()["vars"]["lora_worker_health_url"] == install_script().HEALTH_URL
    assert install_task()["changed_when"] == "'0 change(s)' not in lora_worker_install.stdout"


def test_the_playbook_runs_the_smoke_test_last_and_only_when_asked():
    smoke = play()["tasks"][-1]
    assert "lora-worker smoke --token-file -" in smoke["ansible.builtin.shell"]
    assert smoke["when"] == "lora_worker_smoke | bool" and play()["vars"]["lora_worker_smoke"] is False

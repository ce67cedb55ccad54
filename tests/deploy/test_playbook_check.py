"""`ansible-playbook --check` of deploy/lora-worker.yml against this host runs through to the end: it shows the
installer's dry run (each change it would make), changes nothing the service uses, and skips the health gate;
the play stops, naming what is missing, on a host without the NVIDIA driver unless told it may."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.deploy import ANSIBLE, PLAYBOOK

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(ANSIBLE).exists(), reason="ansible-playbook is not installed (ansible-core, in the "
                                                          "test extras)"),
    pytest.mark.skipif(subprocess.run(["/usr/bin/python3", "-c", "import apt"], capture_output=True).returncode != 0,
                       reason="the apt module's check mode needs /usr/bin/python3 with python3-apt (Debian)"),
]


def check(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ANSIBLE_HOME": str(tmp_path), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    argv = [ANSIBLE, "--check", "-i", "localhost,", "-c", "local", "-e", "lora_worker_hosts=all",
            "-e", "ansible_become=false", "-e", "ansible_python_interpreter=/usr/bin/python3",
            "-e", f"lora_worker_stage={tmp_path / 'stage'}", "-e", f"lora_worker_archive_dir={tmp_path}",
            "-e", f'{{"lora_worker_install_extra_args": ["--root={root}"]}}', *extra, str(PLAYBOOK)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)


def test_check_mode_runs_to_the_end_and_shows_the_installers_changes(tmp_path):
    result = check(tmp_path, "-e", "lora_worker_require_gpu=false")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "failed=0" in out
    for change in ("would: wrote /etc/systemd/system/lora-worker.service",
                   "would: created /etc/lora-worker/api_token (mode 0600)",
                   "would: compile the code's and the venv's byte code", "change(s) (dry run: none made)"):
        assert change in out, change
    gate = out[out.index("TASK [Health gate"):]
    assert gate.split("\n")[1].startswith("skipping:"), gate[:200]
    assert list((tmp_path / "root").iterdir()) == []  # the dry run made nothing


def test_a_host_without_the_nvidia_driver_stops_the_play_and_says_what_is_missing(tmp_path):
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("this host has the NVIDIA driver")
    result = check(tmp_path)
    assert result.returncode != 0
    assert "the NVIDIA driver is missing: no /proc/driver/nvidia/version (the kernel module is not loaded)" in \
        result.stdout, result.stdout
    assert "set lora_worker_require_gpu=false" in result.stdout
    assert "TASK [Install or update" not in result.stdout  # stopped before any change

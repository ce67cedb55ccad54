"""doctor's Slurm checks where no cluster is needed: Slurm's commands absent, and the shared log directory
(present and writable, missing, a link, a file). tests/cluster/test_doctor.py runs them against real clusters."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker.ops.doctor import run_checks, slurm_checks
from lora_worker.host.nvml import FakeNvml
from tests.helpers import make_host

pytestmark = pytest.mark.slow  # every test here starts a real process


def slurm_host(tmp_path: Path, **settings: object):
    empty = tmp_path / "no-slurm-here"
    empty.mkdir(parents=True)
    return replace(make_host(tmp_path).settings, backend="slurm", slurm_bin_dir=empty, **settings)


def test_without_slurms_commands_sinfo_fails_naming_the_command_and_the_fix(tmp_path: Path) -> None:
    settings = slurm_host(tmp_path)
    sinfo, log_dir = slurm_checks(settings)
    assert not sinfo.ok and sinfo.required
    assert f"{settings.slurm_bin_dir}/sinfo is not installed" in sinfo.detail
    assert f"slurm_bin_dir (now {settings.slurm_bin_dir})" in sinfo.detail and "fix:" in sinfo.detail
    assert log_dir.name.startswith("slurm log dir")


def test_with_slurm_the_gpu_checks_give_way_to_the_clusters(tmp_path: Path) -> None:
    settings = slurm_host(tmp_path)
    names = [c.name for c in run_checks(settings, FakeNvml.from_file(settings.nvml_fake_file))]
    assert "slurm sinfo" in names
    assert not any(n == "nvml" or n.startswith("device ") for n in names), names
    local = replace(settings, backend="local")
    local_names = [c.name for c in run_checks(local, FakeNvml.from_file(settings.nvml_fake_file))]
    assert "nvml" in local_names and not any(n.startswith("slurm") for n in local_names)


def log_dir_check(settings):
    return slurm_checks(settings)[-1]


def test_a_writable_log_dir_passes_and_keeps_nothing_of_the_probe(tmp_path: Path) -> None:
    logs = tmp_path / "shared-logs"
    logs.mkdir()
    check = log_dir_check(slurm_host(tmp_path, slurm_log_dir=logs))
    assert check.ok, check.line()
    assert list(logs.iterdir()) == []


def test_a_named_log_dir_that_is_missing_fails_the_default_one_only_warns(tmp_path: Path) -> None:
    named = log_dir_check(slurm_host(tmp_path, slurm_log_dir=tmp_path / "mnt" / "shared"))
    assert not named.ok and named.required and "is the shared storage mounted?" in named.detail, named.line()
    default = log_dir_check(slurm_host(tmp_path / "d"))
    assert not default.ok and not default.required and "the first dispatch creates it" in default.detail


def test_a_log_dir_that_is_a_link_or_a_file_fails(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir()
    link = tmp_path / "logs-link"
    link.symlink_to(real)
    check = log_dir_check(slurm_host(tmp_path, slurm_log_dir=link))
    assert not check.ok and "not a directory (a link or a file)" in check.detail and "fix:" in check.detail
    assert list(real.iterdir()) == []  # nothing written through the link
    plain = tmp_path / "a-file"
    plain.write_text("")
    assert not log_dir_check(slurm_host(tmp_path / "f", slurm_log_dir=plain)).ok

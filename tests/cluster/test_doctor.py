"""`lora-worker doctor` with backend = slurm, against the real test cluster and against a misconfigured one:
every Slurm check passes where the cluster is right, and each fails, saying how to fix it, where it is not."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker.config import Settings
from lora_worker.ops.doctor import Check, slurm_checks
from tests.helpers import make_host
from tests.helpers.service import settings_env
from tests.cluster.cluster import Cluster

pytestmark = pytest.mark.slow


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name.split(" /")[0]: c for c in checks}


@pytest.fixture
def slurm_settings(tmp_path: Path, cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    logs = cluster.shared / tmp_path.name
    logs.mkdir()
    return replace(make_host(tmp_path).settings, backend="slurm", slurm_bin_dir=cluster.bin_dir,
                   slurm_log_dir=logs)


@pytest.fixture(scope="module")
def misconfigured(cluster: Cluster) -> Iterator[Cluster]:
    broken = Cluster(Path(tempfile.mkdtemp(prefix="lw-slurm-broken-", dir="/tmp")), misconfigured=True,
                     munge_of=cluster).start()
    try:
        yield broken
    finally:
        broken.stop()
        assert not broken.leftovers(), broken.leftovers()


def test_on_a_cluster_set_up_as_documented_every_slurm_check_passes(slurm_settings: Settings) -> None:
    checks = slurm_checks(slurm_settings)
    assert [c.name.split(" /")[0] for c in checks] == [
        "slurm sinfo", "slurm partition gpu", "slurm gres gpu in gpu", "slurm proctrack", "slurm sacct",
        "slurm log dir", "slurm node sandbox in gpu"]
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    found = by_name(checks)
    assert found["slurm gres gpu in gpu"].detail == "gpu:fake:2"
    assert found["slurm proctrack"].detail.startswith("proctrack/cgroup")
    assert not list(slurm_settings.slurm_logs.iterdir())  # the probe file is gone again


def test_a_node_of_the_cluster_runs_the_sandbox_probe_through_srun(slurm_settings: Settings) -> None:
    """The batch job's trainer runs in bwrap on the node: doctor asks a node whether it can."""
    check = by_name(slurm_checks(replace(slurm_settings, sandbox="bwrap")))["slurm node sandbox in gpu"]
    assert check.ok and "sandbox bwrap works on a node" in check.detail, check.line()


def test_the_cli_checks_slurm_instead_of_this_hosts_gpus(slurm_settings: Settings, cluster: Cluster) -> None:
    env = {**os.environ, **settings_env(slurm_settings), "LORA_WORKER_NVML_FAKE_FILE": "/nonexistent/gpus.json"}
    done = subprocess.run([sys.executable, "-m", "lora_worker.ops.cli", "doctor"], env=env, capture_output=True,
                          text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert "[  ok] slurm sinfo: answers: 1 partition(s)" in lines, done.stdout + done.stderr
    assert any(line.startswith("[  ok] slurm proctrack: proctrack/cgroup") for line in lines), done.stdout
    assert not any("nvml" in line or line.startswith("[FAIL] device") for line in lines), done.stdout


def test_on_a_misconfigured_cluster_each_check_fails_and_says_the_fix(slurm_settings: Settings,
                                                                     misconfigured: Cluster,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(misconfigured.conf))
    found = by_name(slurm_checks(slurm_settings))
    assert found["slurm sinfo"].ok, found["slurm sinfo"]
    expected = {
        "slurm partition gpu": ("down", "fix: scontrol update PartitionName=gpu State=UP"),
        "slurm gres gpu in gpu": ("no GRES gpu", "fix: GresTypes=gpu and Gres=gpu:<n>"),
        "slurm proctrack": ("proctrack/linuxproc", "fix: ProctrackType=proctrack/cgroup"),
        "slurm sacct": ("sacct exited 1", "fix: run slurmdbd"),
    }
    for name, (problem, fix) in expected.items():
        check = found[name]
        assert not check.ok and check.required, check
        assert problem in check.detail and fix in check.detail, check.line()
    assert found["slurm log dir"].ok  # the worker's side is fine: only the cluster is wrong


def test_a_partition_the_cluster_lacks_is_named_with_those_it_has(slurm_settings: Settings,
                                                                misconfigured: Cluster,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(misconfigured.conf))
    found = by_name(slurm_checks(replace(slurm_settings, slurm_partition="a100")))
    check = found["slurm partition a100"]
    assert not check.ok
    assert "it has: debug, gpu" in check.detail and "set slurm_partition" in check.detail, check.line()
    assert "slurm gres gpu in a100" not in found  # nothing to say of the GPUs of a partition that is not there


def test_an_unreachable_controller_is_one_failed_line_with_the_fix(slurm_settings: Settings, cluster: Cluster,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("".join("SlurmctldPort=1\n" if line.startswith("SlurmctldPort=") else line
                            for line in cluster.conf.read_text().splitlines(keepends=True)))
    (tmp_path / "cgroup.conf").write_text((cluster.conf.parent / "cgroup.conf").read_text())
    monkeypatch.setenv("SLURM_CONF", str(conf))
    checks = slurm_checks(slurm_settings)
    assert [c.name.split(" /")[0] for c in checks] == ["slurm sinfo", "slurm log dir"]
    sinfo = checks[0]
    assert not sinfo.ok and "sinfo exited 1" in sinfo.detail and "Unable to contact slurm controller" in sinfo.detail
    assert f"SLURM_CONF (now {conf})" in sinfo.detail and "fix: start slurmctld" in sinfo.detail, sinfo.line()

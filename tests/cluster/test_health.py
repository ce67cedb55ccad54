"""The deep health check under Slurm (slurm/health.py) against real clusters: the documented one passes each check,
the probe job runs the trainer probe on its node through srun, and a misconfigured or unreachable cluster fails
the check that names what is wrong. tests/slurm/test_health.py holds the same promises against fake Slurm tools."""
from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker.config import Settings
from lora_worker.dispatch.readiness import DeepHealth
from lora_worker.host.nvml import FakeNvml
from lora_worker.slurm.health import cluster_checks
from lora_worker.slurm.scheduler import Scheduler
from tests.cluster.cluster import Cluster
from tests.cluster.worker import slurm_settings
from tests.helpers import make_host

pytestmark = pytest.mark.slow

ALL_TIERS = "slurm nodes for fast, balanced, quality"
PROBE = "slurm trainer probe for fast, balanced, quality"


def by_name(checks: list) -> dict:
    return {c.name: c for c in checks}


@pytest.fixture
def settings(tmp_path: Path, cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    host = make_host(tmp_path)
    return host.settings.with_overrides(**slurm_settings(cluster, tmp_path))


@pytest.fixture(scope="module")
def misconfigured(cluster: Cluster) -> Iterator[Cluster]:
    broken = Cluster(Path(tempfile.mkdtemp(prefix="lw-slurm-broken-", dir="/tmp")), misconfigured=True,
                     munge_of=cluster).start()
    try:
        yield broken
    finally:
        broken.stop()
        assert not broken.leftovers(), broken.leftovers()


def test_on_the_documented_cluster_the_controller_and_a_gpu_node_pass(settings: Settings, cluster: Cluster):
    checks = by_name(cluster_checks(settings, Scheduler(cluster.bin_dir), trainer=False))
    assert list(checks) == ["slurm controller", ALL_TIERS]
    assert checks["slurm controller"].ok and "is UP" in checks["slurm controller"].detail, checks
    nodes = checks[ALL_TIERS]
    assert nodes.ok and "1 of 1 node(s) of gpu usable with gres gpu:1" in nodes.detail, nodes.line()


def test_the_probe_job_runs_the_trainer_probe_on_the_node(settings: Settings, cluster: Cluster):
    """srun takes the node's GPU and runs `python -m lora_worker.run.node --probe-trainer` there: the simulated
    trainer's interpreter starts in the job's sandbox and environment (the node is this host)."""
    probing = settings.with_overrides(slurm_probe_job=True, trainer_kind="simulated")
    probe = by_name(cluster_checks(probing, Scheduler(cluster.bin_dir), trainer=True))[PROBE]
    assert probe.ok and probe.simulated and probe.detail.startswith("on node "), probe.line()
    assert [p.name for p in probing.slurm_logs.iterdir()] == []  # the probe's settings file is gone


def test_the_probe_with_both_gpus_taken_is_not_checked_not_failed(settings: Settings, cluster: Cluster,
                                                                  tmp_path: Path):
    from tests.cluster.worker import fill_node

    taken = fill_node(cluster, tmp_path)
    try:
        probing = settings.with_overrides(slurm_probe_job=True, trainer_kind="simulated")
        probe = by_name(cluster_checks(probing, Scheduler(cluster.bin_dir), trainer=True))[PROBE]
        assert not probe.checked and not probe.failed and "no node with a free gpu:1" in probe.detail, probe.line()
    finally:
        for job in taken:
            cluster.run("scancel", job, check=False)


def test_the_service_start_up_check_fails_on_a_misconfigured_cluster(settings: Settings, misconfigured: Cluster,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """The misconfigured cluster's nodes have no GRES and its partition is down: the gate the installer and the
    playbook poll answers failing, naming the tiers that could not run."""
    monkeypatch.setenv("SLURM_CONF", str(misconfigured.conf))
    result = DeepHealth(replace(settings, slurm_bin_dir=misconfigured.bin_dir), FakeNvml(absent=True)).run()
    assert result["status"] == "failing" and ALL_TIERS in result["failed"], result
    nodes = next(c for c in result["checks"] if c["name"] == ALL_TIERS)
    assert "no node of gpu has gres gpu:1" in nodes["detail"] or "usable" in nodes["detail"], nodes


def test_an_unreachable_controller_fails_the_controller_check(settings: Settings, cluster: Cluster, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    conf = tmp_path / "slurm.conf"
    conf.write_text("".join("SlurmctldPort=1\n" if line.startswith("SlurmctldPort=") else line
                            for line in cluster.conf.read_text().splitlines(keepends=True)))
    (tmp_path / "cgroup.conf").write_text((cluster.conf.parent / "cgroup.conf").read_text())
    monkeypatch.setenv("SLURM_CONF", str(conf))
    checks = cluster_checks(settings, Scheduler(cluster.bin_dir), trainer=True)
    assert [c.name for c in checks] == ["slurm controller", ALL_TIERS, "slurm trainer probe"]
    assert checks[0].failed and "fix: start slurmctld" in checks[0].detail, checks[0].line()
    assert not checks[1].checked and not checks[2].checked

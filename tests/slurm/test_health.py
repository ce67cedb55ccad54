"""The deep health check under Slurm (slurm/health.py): GET /healthz?deep=1 and `doctor` ask the cluster whether a
job can run there now (the controller answers, the partition has a usable node with each tier's GPU, and, opt-in,
a probe job starts the trainer on a node); what they cannot check they say, and `doctor --strict` fails on it.
Before, the deep check returned nothing under Slurm, so the deploy gates passed a cluster where nothing could run.
tests/cluster/test_health.py runs the same against a real cluster."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from lora_worker.config import SlurmResources, Settings
from lora_worker.dispatch.readiness import DeepHealth
from lora_worker.host.nvml import FakeNvml
from lora_worker.ops import cli
from lora_worker.slurm.health import cluster_checks, feature_test, gpus_offered, has_gpu, usable_state
from lora_worker.slurm.scheduler import Node, Scheduler, parse_ping, parse_sinfo_nodes
from tests.helpers import Host
from tests.slurm.fakes import SlurmWorker, install_fake_slurm

ALL_TIERS = "slurm nodes for fast, balanced, quality"


def by_name(checks) -> dict:
    """Checks (or their dicts, as /healthz serves them) by name."""
    return {c["name"] if isinstance(c, dict) else c.name: c for c in checks}


def deep(slurm: SlurmWorker, timeout: float = 20.0) -> tuple[int, dict]:
    """/healthz?deep=1 once the start-up checks (run here, as the service runs them) are done."""
    worker = slurm.client.application.extensions["lora_worker"]  # type: ignore[attr-defined]
    worker.deep_health.start().wait(timeout)
    answer = slurm.client.get("/healthz?deep=1")
    return answer.status_code, answer.get_json()


def test_a_cluster_without_a_usable_gpu_node_fails_the_deep_gate(slurm: SlurmWorker):
    """The regression: the gate answered 200 "ok" under Slurm whatever the cluster was."""
    slurm.scheduler.cluster = [Node("n1", "drained", "gpu:fake:2", "(null)"), Node("n2", "idle", "(null)", "(null)")]
    status, body = deep(slurm)
    assert status == 503 and body["error"] == "host_not_ready", body
    assert ALL_TIERS in body["details"]["deep"]["failed"]
    check = by_name(body["details"]["deep"]["checks"])[ALL_TIERS]
    assert "n1 (drained)" in check["detail"] and "State=RESUME" in check["detail"]


def test_a_cluster_that_can_run_jobs_passes_and_says_what_it_did_not_check(slurm: SlurmWorker):
    status, body = deep(slurm)
    assert status == 200, body
    result = body["deep"]
    assert result["status"] == "ok" and result["failed"] == []
    assert [c["name"] for c in result["checks"]] == ["slurm controller", ALL_TIERS, "slurm trainer probe"]
    assert result["unchecked"] == ["slurm trainer probe"]  # slurm_probe_job is off: said, never passed
    probe = by_name(result["checks"])["slurm trainer probe"]
    assert probe["checked"] is False and probe["detail"].startswith("not checked: slurm_probe_job is off")
    assert not any(c["name"].startswith(("nvml", "device nodes", "sandbox")) for c in result["checks"])


def test_a_silent_controller_fails_and_leaves_the_rest_unchecked(slurm: SlurmWorker):
    slurm.scheduler.down = True
    status, body = deep(slurm)
    assert status == 503 and body["details"]["deep"]["failed"] == ["slurm controller"]
    assert body["details"]["deep"]["unchecked"] == [ALL_TIERS, "slurm trainer probe"]


def test_a_controller_that_says_down_fails(slurm: SlurmWorker):
    slurm.scheduler.controller = "DOWN"
    checks = by_name(cluster_checks(slurm.settings, slurm.scheduler, trainer=False))
    assert not checks["slurm controller"].ok and "is DOWN" in checks["slurm controller"].detail


def test_each_set_of_tier_resources_is_checked_on_its_own(slurm: SlurmWorker):
    settings = slurm.settings.with_overrides(slurm_resources={
        **Settings().slurm_resources, "quality": SlurmResources(gres="gpu:a6000:1", constraint="big&nvlink")})
    slurm.scheduler.cluster = [Node("small", "mixed", "gpu:rtx3090:2(S:0-1)", "small"),
                               Node("big", "idle", "gpu:a6000:1", "big")]  # no nvlink
    checks = by_name(cluster_checks(settings, slurm.scheduler, trainer=False))
    assert checks["slurm nodes for fast, balanced"].ok
    assert "small (mixed), big (idle)" in checks["slurm nodes for fast, balanced"].detail
    quality = checks["slurm nodes for quality"]
    assert not quality.ok and "no node of gpu has gres gpu:a6000:1 and features big&nvlink" in quality.detail
    slurm.scheduler.cluster[1] = Node("big", "idle", "gpu:a6000:1", "big,nvlink")
    assert by_name(cluster_checks(settings, slurm.scheduler, trainer=False))["slurm nodes for quality"].ok


def test_a_constraint_it_cannot_read_is_said_unchecked_not_passed(slurm: SlurmWorker):
    settings = slurm.settings.with_overrides(slurm_resources={
        **Settings().slurm_resources, "quality": SlurmResources(constraint="[a100*2|h100*2]")})
    quality = by_name(cluster_checks(settings, slurm.scheduler, trainer=False))["slurm nodes for quality"]
    assert not quality.checked and not quality.failed and "[a100*2|h100*2]" in quality.detail


def test_a_partition_with_no_node_fails_naming_it(slurm: SlurmWorker):
    slurm.scheduler.cluster = []
    check = by_name(cluster_checks(slurm.settings, slurm.scheduler, trainer=False))[ALL_TIERS]
    assert check.failed and "partition gpu lists no node" in check.detail


@pytest.mark.parametrize(("state", "usable"), [
    ("idle", True), ("mixed", True), ("allocated", True), ("completing", True), ("idle~", True), ("mixed#", True),
    ("idle+cloud", True), ("down*", False), ("idle*", False), ("drained", False), ("draining", False),
    ("down", False), ("fail", False), ("maint", False), ("reserved", False), ("idle$", False),
    ("idle+drain", False), ("unknown*", False)])
def test_which_node_states_take_new_jobs(state, usable):
    assert usable_state(state) is usable


def test_the_gpus_a_node_offers_are_read_from_its_gres():
    assert gpus_offered("gpu:a100:4(S:0-1),gpu:2,mps:100") == [("a100", 4), (None, 2)]
    assert gpus_offered("gpu:fake:2") == [("fake", 2)] and gpus_offered("(null)") == []
    assert gpus_offered("gpu:a100:2(S:0,1),gpu:v100:1") == [("a100", 2), ("v100", 1)]
    assert has_gpu("gpu:fake:2", "gpu:1") and has_gpu("gpu:a100:1", "gpu:a100:1")
    assert not has_gpu("gpu:2", "gpu:a100:1") and not has_gpu("gpu:v100:1", "gpu:a100:1")
    assert not has_gpu("gpu:a100:0", "gpu:1") and not has_gpu("(null)", "gpu:1")


def test_a_constraint_is_read_as_slurm_reads_and_and_or():
    both, either = feature_test("big&nvlink"), feature_test("a100|h100")
    assert both is not None and either is not None
    assert both("big,nvlink,x") and not both("big")
    assert either("h100") and not either("v100,(null)")
    assert feature_test("")("(null)")  # type: ignore[misc]
    assert feature_test("a100&h100|v100") is None and feature_test("[a|b]") is None


def test_what_slurm_prints_is_parsed():
    assert parse_ping("Slurmctld(primary) at ctl1 is UP\nSlurmctld(backup) at ctl2 is DOWN\n") == [
        ("Slurmctld(primary) at ctl1", "UP"), ("Slurmctld(backup) at ctl2", "DOWN")]
    assert parse_sinfo_nodes("n1|mixed|gpu:fake:2|(null)\n\nn2|down*|gpu:fake:2|big,fast\n") == [
        Node("n1", "mixed", "gpu:fake:2", "(null)"), Node("n2", "down*", "gpu:fake:2", "big,fast")]


@pytest.fixture
def tools(host: Host, tmp_path: Path) -> tuple[Settings, Path]:
    """Slurm's command-line tools (the fake ones: this host is the node) and a worker's Slurm settings."""
    bins = install_fake_slurm(tmp_path / "slurm-bin")
    logs = tmp_path / "shared"
    logs.mkdir()
    return host.settings.with_overrides(backend="slurm", slurm_bin_dir=bins, slurm_log_dir=logs), bins


@pytest.mark.slow  # Slurm's commands are processes
def test_the_commands_are_asked_as_the_scheduler_runs_them(tools):
    settings, bins = tools
    checks = by_name(cluster_checks(settings, Scheduler(bins), trainer=False))
    assert checks["slurm controller"].ok and "Slurmctld(primary) at fakectl is UP" in checks["slurm controller"].detail
    assert checks[ALL_TIERS].ok and "fakenode (idle)" in checks[ALL_TIERS].detail
    (bins / "nodes").write_text("fakenode|down*|gpu:fake:2|(null)\n")
    assert by_name(cluster_checks(settings, Scheduler(bins), trainer=False))[ALL_TIERS].failed


@pytest.mark.slow  # srun starts the trainer probe as a process
def test_the_opt_in_probe_job_runs_the_trainer_probe_on_a_node(tools):
    """The fake srun runs it here, as a node with one GPU would: the same probe as the local deep check, in the
    job's sandbox and environment, with the settings passed through the shared log dir (and removed after)."""
    settings, bins = tools
    settings = settings.with_overrides(slurm_probe_job=True, trainer_kind="simulated")
    probe = by_name(cluster_checks(settings, Scheduler(bins), trainer=True))["slurm trainer probe for fast, balanced, "
                                                                             "quality"]
    assert probe.ok and probe.simulated and probe.detail.startswith("on node "), probe.line()
    assert "starts in the job's sandbox and environment" in probe.detail
    assert list(settings.slurm_logs.iterdir()) == []


@pytest.mark.slow
def test_a_probe_whose_trainer_cannot_start_fails_and_no_free_node_is_unchecked(tools):
    settings, bins = tools
    settings = settings.with_overrides(slurm_probe_job=True, accelerate=settings.state_dir / "no-accelerate")
    name = "slurm trainer probe for fast, balanced, quality"
    broken = by_name(cluster_checks(settings, Scheduler(bins), trainer=True))[name]
    assert broken.failed and "no-accelerate is missing: no trainer to start" in broken.detail, broken.line()
    (bins / "trouble").write_text("busy")
    busy = by_name(cluster_checks(settings, Scheduler(bins), trainer=True))
    assert busy["slurm controller"].ok and not busy[name].checked and "no node with a free gpu:1" in busy[name].detail


@pytest.mark.slow  # doctor's Slurm checks run Slurm's commands and srun
def test_doctor_strict_fails_on_what_it_could_not_check(tools, monkeypatch):
    settings, _ = tools
    monkeypatch.setattr(cli, "load_settings", lambda: settings)
    outputs = {}
    for strict in (False, True):
        out = io.StringIO()
        with redirect_stdout(out):
            status = cli.main(["doctor", *(["--strict"] if strict else [])])
        outputs[strict] = (status, out.getvalue().splitlines())
    status, lines = outputs[True]
    assert "[  ok] slurm controller: Slurmctld(primary) at fakectl is UP" in lines, lines
    assert any(line.startswith(f"[  ok] {ALL_TIERS}: 1 of 1 node(s) of gpu usable") for line in lines), lines
    assert "[skip] slurm trainer probe: not checked: slurm_probe_job is off" in "\n".join(lines)
    assert lines[-1] == "doctor --strict: not checked, so not proven: slurm trainer probe" and status == 1
    assert "1 not checked" in next(line for line in lines if "checks passed" in line)
    _, plain = outputs[False]  # without --strict, nothing that starts the trainer is asked, so nothing is unchecked
    assert not any("slurm trainer probe" in line or "not checked" in line for line in plain), plain


def test_the_deep_result_names_what_was_not_checked_and_stays_ok(slurm: SlurmWorker):
    backend = slurm.client.application.extensions["lora_worker"].backend  # type: ignore[attr-defined]
    result = DeepHealth(slurm.settings, FakeNvml(absent=True), backend).run()  # no GPU here: none needed
    assert result["status"] == "ok" and result["unchecked"] == ["slurm trainer probe"], result
    assert json.loads(json.dumps(result)) == result  # served as it is

"""The deploy gates on the deep health check, not on a bare 200: the installer's health gate and the playbook's
poll `GET /healthz?deep=1`, which the real service (gunicorn, wsgi.py) answers from the checks it ran at
start-up. And `lora-worker doctor --strict`, the same checks from a terminal."""
from __future__ import annotations

import pytest

import json
import time
import urllib.error
import urllib.request

import yaml

from lora_worker.config import REPO_ROOT
from tests.helpers import install_script
from tests.helpers.service import Service

pytestmark = pytest.mark.slow  # every test here starts real processes


def deep(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/healthz?deep=1", timeout=5) as response:  # noqa: S310
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_installer_and_the_playbook_gate_on_the_deep_check():
    assert install_script().HEALTH_URL == "http://127.0.0.1:8203/healthz?deep=1"
    play = yaml.safe_load((REPO_ROOT / "deploy" / "lora-worker.yml").read_text())[0]
    assert play["vars"]["lora_worker_health_url"].endswith("/healthz?deep=1")


def test_the_gate_refuses_a_host_that_answers_200_but_cannot_train(migrated, host):
    """The test host's trainer lives in /tmp, which the unit's PrivateTmp hides: a bare /healthz says 200."""
    script = install_script()
    service = Service(migrated, host.root / "gunicorn.log").start()
    try:
        assert script.health_gate(f"{service.url}/healthz", timeout_s=10) is True
        assert script.health_gate(f"{service.url}/healthz?deep=1", timeout_s=3) is False
        status, body = deep(service.url)
        assert status == 503 and body["error"] == "host_not_ready" and body["retryable"] is False
        assert "trainer outside the unit's hidden paths" in body["details"]["deep"]["failed"]
    finally:
        service.stop()


def test_the_gate_passes_a_simulated_host_and_says_it_was_simulated(migrated, host):
    service = Service(migrated, host.root / "gunicorn.log",
                      extra_env={"LORA_WORKER_TRAINER_KIND": "simulated"}).start()
    try:
        deadline = time.monotonic() + 30
        while (answer := deep(service.url))[0] == 503 and answer[1]["details"]["deep"]["status"] == "pending" \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = answer
        assert status == 200, body
        assert body["deep"]["simulated"] is True
        assert install_script().health_gate(f"{service.url}/healthz?deep=1", timeout_s=5) is True
    finally:
        service.stop()


def settled(url: str, timeout: float = 30) -> tuple[int, dict]:
    """/healthz?deep=1 once the start-up checks are no longer pending."""
    deadline = time.monotonic() + timeout
    while (answer := deep(url))[0] == 503 and answer[1]["details"]["deep"]["status"] == "pending" \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return answer


@pytest.mark.parametrize("node", ["n1|drained|gpu:fake:2|(null)", "n1|idle|(null)|(null)"])
def test_under_slurm_the_gate_refuses_a_cluster_with_no_usable_gpu_node(migrated, host, tmp_path, node):
    """The regression: under Slurm the deep checks were none, so both gates passed whatever the cluster was. Slurm's
    tools here are the fake ones (tests/slurm/fake_slurm), their partition's one node drained or without a GPU."""
    from tests.slurm.fakes import install_fake_slurm

    bins = install_fake_slurm(tmp_path / "slurm-bin")
    (bins / "nodes").write_text(node + "\n")
    settings = migrated.with_overrides(backend="slurm", slurm_bin_dir=bins, slurm_log_dir=tmp_path / "shared")
    service = Service(settings, host.root / "gunicorn.log").start()
    try:
        status, body = settled(service.url)
        assert status == 503 and body["error"] == "host_not_ready", body
        assert body["details"]["deep"]["failed"] == ["slurm nodes for fast, balanced, quality"]
        assert install_script().health_gate(f"{service.url}/healthz?deep=1", timeout_s=2) is False
    finally:
        service.stop()


def test_under_slurm_the_gate_passes_a_cluster_that_can_run_jobs_and_lists_what_it_did_not_check(migrated, host,
                                                                                                  tmp_path):
    from tests.slurm.fakes import install_fake_slurm

    bins = install_fake_slurm(tmp_path / "slurm-bin")  # one idle node with two GPUs
    settings = migrated.with_overrides(backend="slurm", slurm_bin_dir=bins, slurm_log_dir=tmp_path / "shared")
    service = Service(settings, host.root / "gunicorn.log").start()
    try:
        status, body = settled(service.url)
        assert status == 200, body
        assert [c["name"] for c in body["deep"]["checks"] if c["ok"]] == [
            "slurm controller", "slurm nodes for fast, balanced, quality"]
        assert body["deep"]["unchecked"] == ["slurm trainer probe"]  # slurm_probe_job is off by default
        assert install_script().health_gate(f"{service.url}/healthz?deep=1", timeout_s=5) is True
    finally:
        service.stop()

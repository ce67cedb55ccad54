"""GET /metrics: Prometheus text read from the ledger and NVML at scrape time, right across processes."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lora_worker import create_app
from lora_worker.ledger import repository as repo
from lora_worker.ledger.models import utcnow
from lora_worker.states import JobState
from lora_worker.host.locks import hold_lock, job_lock_path
from tests.helpers import fake_gpus
from tests.helpers.ledger import columns

FAMILIES = {
    "lora_worker_jobs": "gauge",
    "lora_worker_job_failures": "gauge",
    "lora_worker_job_duration_seconds": "histogram",
    "lora_worker_reconcile_actions": "gauge",
    "lora_worker_webhook_events": "gauge",
    "lora_worker_queue_depth": "gauge",
    "lora_worker_active_jobs": "gauge",
    "lora_worker_active_job_phase": "gauge",
    "lora_worker_active_job_step_rate": "gauge",
    "lora_worker_active_job_step": "gauge",
    "lora_worker_active_job_total_steps": "gauge",
    "lora_worker_nvml_up": "gauge",
    "lora_worker_gpu_memory_used_bytes": "gauge",
    "lora_worker_gpu_memory_total_bytes": "gauge",
}


@pytest.fixture
def api(migrated):
    app = create_app(migrated, launch=lambda job_id, settings: None)
    yield app.test_client()
    app.extensions["lora_worker"].db.dispose()


def scrape(client) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """{family: {(sample name, sorted labels): value}}"""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.content_type.startswith("text/plain; version=")
    return {family.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
            for family in text_string_to_metric_families(response.get_data(as_text=True))}


def finished(db, state: JobState, seconds: float, **values: object) -> int:
    """A job that ran `seconds` and ended in `state`."""
    job = repo.create_job(db, columns())
    start = utcnow() - timedelta(hours=1)
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", started_at=start)
    repo.transition(db, job.id, state, actor="supervisor", finished_at=start + timedelta(seconds=seconds), **values)
    return job.id


def test_metrics_are_prometheus_text_with_every_family(api):
    response = api.get("/metrics")
    families = {f.name: f.type for f in text_string_to_metric_families(response.get_data(as_text=True))}
    assert families == FAMILIES


def test_jobs_by_final_state_and_failures_by_class_come_from_the_ledger(api, db):
    finished(db, JobState.SUCCEEDED, 100)
    finished(db, JobState.SUCCEEDED, 200)
    finished(db, JobState.FAILED, 50, failure_class="cuda_oom")
    finished(db, JobState.CANCELLED, 10)
    metrics = scrape(api)
    jobs = {dict(labels)["status"]: v for (_, labels), v in metrics["lora_worker_jobs"].items()}
    assert jobs == {"queued": 0, "running": 0, "succeeded": 2, "failed": 1, "cancelled": 1}
    failures = {dict(labels)["failure_class"]: v for (_, labels), v in metrics["lora_worker_job_failures"].items()}
    assert failures["cuda_oom"] == 1 and sum(failures.values()) == 1


def test_job_duration_is_a_histogram_of_start_to_end_by_final_status(api, db):
    for seconds in (30, 400, 7000):
        finished(db, JobState.SUCCEEDED, seconds)
    finished(db, JobState.FAILED, 90, failure_class="stalled")
    samples = scrape(api)["lora_worker_job_duration_seconds"]

    def sample(name: str, status: str, le: str | None = None) -> float:
        labels = {"status": status, **({"le": le} if le else {})}
        return samples[(name, tuple(sorted(labels.items())))]

    assert sample("lora_worker_job_duration_seconds_count", "succeeded") == 3
    assert sample("lora_worker_job_duration_seconds_sum", "succeeded") == pytest.approx(7430, abs=0.01)
    assert [sample("lora_worker_job_duration_seconds_bucket", "succeeded", le) for le in ("60.0", "600.0", "3600.0",
                                                                                          "7200.0", "+Inf")] == [
        1, 2, 2, 3, 3]
    assert sample("lora_worker_job_duration_seconds_count", "failed") == 1


def test_the_active_job_shows_its_phase_step_and_step_rate(api, db, migrated):
    job = repo.create_job(db, columns())
    lock = hold_lock(job_lock_path(migrated, job.id))  # its supervisor is alive
    assert lock is not None
    try:
        repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", phase="training")
        repo.update_running(db, job.id, step=120, rate=2.5)
        metrics = scrape(api)
    finally:
        os.close(lock)
    phases = {dict(labels)["phase"]: v for (_, labels), v in metrics["lora_worker_active_job_phase"].items()}
    assert phases["training"] == 1 and sum(phases.values()) == 1
    assert metrics["lora_worker_active_jobs"][("lora_worker_active_jobs", ())] == 1
    assert metrics["lora_worker_active_job_step_rate"] == {("lora_worker_active_job_step_rate", ()): 2.5}
    assert metrics["lora_worker_active_job_step"] == {("lora_worker_active_job_step", ()): 120}
    assert metrics["lora_worker_active_job_total_steps"] == {("lora_worker_active_job_total_steps", ()): 400}


def test_a_dead_supervisor_shows_as_a_reconcile_action_not_as_a_running_phase(api, db):
    # a supervisor that failed its own job after an internal error is not a reconcile
    own = repo.create_job(db, columns(train_id="t2"))
    repo.transition(db, own.id, JobState.RUNNING, actor="supervisor")
    repo.transition(db, own.id, JobState.FAILED, actor="supervisor", failure_class="supervisor_lost")
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", phase="training")  # no lock: nobody home
    metrics = scrape(api)
    assert sum(metrics["lora_worker_active_job_phase"].values()) == 0
    assert metrics["lora_worker_active_job_step_rate"] == {}
    assert metrics["lora_worker_reconcile_actions"] == {
        ("lora_worker_reconcile_actions", (("actor", "api"), ("failure_class", "supervisor_lost"))): 1}


@pytest.mark.slow
def test_a_job_another_process_finished_shows_at_the_next_scrape(api, db, migrated):
    assert scrape(api)["lora_worker_jobs"][("lora_worker_jobs", (("status", "succeeded"),))] == 0
    script = (
        "import sys; from lora_worker.ledger.db import Database; from lora_worker.ledger import repository as repo\n"
        "from lora_worker.states import JobState; from tests.helpers.ledger import columns\n"
        "db = Database.open(__import__('pathlib').Path(sys.argv[1])); job = repo.create_job(db, columns())\n"
        "repo.transition(db, job.id, JobState.RUNNING, actor='supervisor')\n"
        "repo.transition(db, job.id, JobState.SUCCEEDED, actor='supervisor'); db.dispose()\n")
    subprocess.run([sys.executable, "-c", script, str(migrated.database_path)], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert scrape(api)["lora_worker_jobs"][("lora_worker_jobs", (("status", "succeeded"),))] == 1


def test_gpu_memory_per_device_comes_from_nvml_in_bytes(api, host):
    fake_gpus(host.gpus, free0=4_576, free1=49_140)
    metrics = scrape(api)
    used = {dict(labels)["device"]: v for (_, labels), v in metrics["lora_worker_gpu_memory_used_bytes"].items()}
    total = {dict(labels)["device"]: v for (_, labels), v in metrics["lora_worker_gpu_memory_total_bytes"].items()}
    assert used == {"0": 20_000 * 2**20, "1": 0}
    assert total == {"0": 24_576 * 2**20, "1": 49_140 * 2**20}
    assert metrics["lora_worker_nvml_up"] == {("lora_worker_nvml_up", ()): 1}


def test_without_nvml_the_scrape_still_answers_and_says_so(api, host):
    fake_gpus(host.gpus, absent=True)
    metrics = scrape(api)
    assert metrics["lora_worker_nvml_up"] == {("lora_worker_nvml_up", ()): 0}
    assert metrics["lora_worker_gpu_memory_used_bytes"] == {}

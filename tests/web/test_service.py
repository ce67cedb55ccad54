"""The service under gunicorn: training survives the web process, and a restart picks the job up again."""
from __future__ import annotations

import json

import pytest

from tests.helpers import pid_alive, set_modes, wait_for
from tests.helpers.service import Service

pytestmark = pytest.mark.slow


@pytest.fixture
def service(host, migrated):
    svc = Service(migrated, host.root / "gunicorn.log").start()
    yield svc
    svc.stop()


def status(svc: Service, job_id: int) -> dict:
    return svc.request("GET", f"/train/{job_id}")[1]


def test_kill_9_of_the_web_process_does_not_stop_training(service, host):
    record = host.root / "record.json"
    set_modes(host.sd_scripts, step_s=0.01, record=str(record))
    code, body, _ = service.request("POST", "/train", host.payload())
    assert code == 202, body
    job_id = body["worker_job_id"]
    wait_for(lambda: status(service, job_id)["step"] > 0, what="first steps")
    trainer = json.loads(record.read_text())["pid"]
    service.kill_9()
    assert pid_alive(trainer)  # the trainer outlives the web process
    before = None
    restarted = Service(host.settings, host.root / "gunicorn2.log").start()
    try:
        before = status(restarted, job_id)
        assert before["status"] in ("running", "succeeded"), before
        done = wait_for(lambda: (j := status(restarted, job_id))["status"] != "running" and j, timeout=60,
                        what="job end")
        assert done["status"] == "succeeded" and done["step"] == 400 and done["step"] >= before["step"]
    finally:
        restarted.stop()


def test_a_graceful_restart_of_gunicorn_leaves_training_running(service, host):
    set_modes(host.sd_scripts, hang_in="training", record=str(host.root / "record.json"))
    job_id = service.request("POST", "/train", host.payload())[1]["worker_job_id"]
    wait_for(lambda: status(service, job_id)["phase"] == "training", what="training")
    service.stop()  # SIGTERM: gunicorn's graceful stop, as systemctl restart with KillMode=process
    trainer = json.loads((host.root / "record.json").read_text())["pid"]
    assert pid_alive(trainer)
    again = Service(host.settings, host.root / "gunicorn2.log").start()
    try:
        assert status(again, job_id)["status"] == "running"
        assert again.request("POST", f"/train/{job_id}/cancel")[0] == 202
        assert wait_for(lambda: status(again, job_id)["status"] == "cancelled", what="cancelled")
        assert wait_for(lambda: not pid_alive(trainer), timeout=5, what="trainer gone")
    finally:
        again.stop()


def test_errors_over_real_http_are_json(service):
    code, body, headers = service.request("GET", "/train/12345")
    assert code == 404 and body["error"] == "job_not_found" and headers["Content-Type"] == "application/json"
    code, body, _ = service.request("POST", "/train", {"tier": "fast"})
    assert code == 422 and set(body["fields"]) >= {"dataset_dir", "seed"}

"""Honest time: an estimate at acceptance from history, a measured ETA in training, and the loss curve."""
from __future__ import annotations

from datetime import timedelta

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.ledger.models import utcnow
from lora_worker.states import JobState, Phase
from lora_worker.run.eta import EtaClock, estimate_duration
from tests.ledger.test_ledger import columns


def test_the_measured_rate_leaves_the_warm_up_out():
    clock = EtaClock(total_steps=100, estimated_duration_s=None)
    clock.observe(1, now=30.0)  # a 30 s first step (compilation, caches)
    for step in range(2, 12):
        clock.observe(step, now=30.0 + (step - 1) * 2.0)  # then 2 s a step
    assert clock.rate() == pytest.approx(0.5)
    eta, basis = clock.eta(Phase.TRAINING, 11, elapsed_s=50)
    assert (eta, basis) == (pytest.approx(178.0), "measured")
    # tqdm, averaging since the bar opened, would have said (100 - 11) * 50 / 11 = 404 s


def test_before_training_the_eta_is_the_history_estimate_and_says_so():
    clock = EtaClock(total_steps=400, estimated_duration_s=600.0)
    assert clock.eta(Phase.LOADING_MODEL, 0, elapsed_s=100) == (500.0, "history")
    assert clock.eta(Phase.LOADING_MODEL, 0, elapsed_s=900) == (0.0, "history")
    assert EtaClock(400, None).eta(Phase.LOADING_MODEL, 0, 10) == (None, None)


def test_the_estimate_is_the_median_of_similar_jobs_or_nothing():
    assert estimate_duration([]) is None
    assert estimate_duration([100.0, 400.0, 130.0]) == 130.0


def seed_history(db, durations: list[float], **match: object) -> None:
    for seconds in durations:
        job = repo.create_job(db, columns(**match))
        start = utcnow() - timedelta(hours=2)
        repo.transition(db, job.id, JobState.RUNNING, actor="seed", started_at=start)
        repo.transition(db, job.id, JobState.SUCCEEDED, actor="seed", finished_at=start + timedelta(seconds=seconds))


def test_acceptance_gives_an_estimate_from_similar_jobs_only(api, host, db, launches):
    seed_history(db, [300.0, 500.0, 400.0], tier="fast", device_index=1, image_count=3)
    seed_history(db, [9999.0], tier="fast", device_index=1, image_count=4)  # other image count
    seed_history(db, [8888.0], tier="balanced", device_index=1, image_count=3)  # other tier
    response = api.post("/train", json=host.payload())
    assert response.get_json()["estimated_duration_s"] == pytest.approx(400.0, abs=0.01)
    job_id = response.get_json()["worker_job_id"]
    assert launches == [job_id]  # stored with the row the run reads it from (test_loop_rules: the countdown)
    assert api.get(f"/train/{job_id}").get_json()["estimated_duration_s"] == pytest.approx(400.0, abs=0.01)


def test_with_no_history_the_estimate_is_null(api, host):
    response = api.post("/train", json=host.payload())
    assert response.status_code == 202 and response.get_json()["estimated_duration_s"] is None


def test_the_loss_curve_is_served_thinned_to_the_points_asked(client, db):
    # The points as the supervisor writes them (test_loop_rules: none lost; test_supervisor: a real run's).
    job = repo.create_job(db, columns())
    start = utcnow() - timedelta(minutes=10)
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", started_at=start)
    for first in range(1, 401, 40):
        points = [(s, 1.0 / s, start + timedelta(seconds=s)) for s in range(first, first + 40)]
        assert repo.update_running(db, job.id, points=points, step=first + 39)
    repo.transition(db, job.id, JobState.FAILED, actor="supervisor", failure_class="trainer_crashed")
    full = client.get(f"/train/{job.id}/progress?points=5000").get_json()
    steps = [p["step"] for p in full["points"]]
    assert full["total_steps"] == 400 and steps == list(range(1, 401))
    ts = [p["t"] for p in full["points"]]
    assert ts == sorted(ts) and ts[0] >= 0
    thin = client.get(f"/train/{job.id}/progress?points=20").get_json()["points"]
    assert len(thin) == 20 and thin[0] == full["points"][0] and thin[-1] == full["points"][-1]
    assert client.get(f"/train/{job.id}/progress?points=0").status_code == 422
    assert client.get("/train/999/progress").status_code == 404

"""Honest time: an estimate at acceptance from history; a running ETA that includes the save and teardown,
is measured from the first step and counts down between steps; none once the job is over; the loss curve."""
from __future__ import annotations

from datetime import timedelta

import pytest

from bench.eta_replay import RUNS, Capture, histories, replay
from lora_worker.ledger import repository as repo
from lora_worker.ledger.models import utcnow
from lora_worker.states import JobState, Phase
from lora_worker.transcript.eta import DEFAULT_TAIL_S, EtaClock, estimate_duration, estimate_tail
from tests.helpers import wait_for
from tests.helpers.ledger import columns
from tests.helpers.runs import TERMINAL, job, modes, submit, wait_phase, wait_state

TRAINING = Phase.TRAINING


def training_clock(total: int, tail: float = 10.0, estimate: float | None = None, opened: float = 100.0) -> EtaClock:
    clock = EtaClock(total_steps=total, estimated_duration_s=estimate, tail_s=tail)
    clock.follow(TRAINING, 0, opened)  # the steps bar shows 0/N
    return clock


# -- the clock, with a fake time --------------------------------------------------------------------------------

def test_the_measured_rate_leaves_the_warm_up_out():
    clock = training_clock(100, tail=0.0, opened=0.0)
    clock.follow(TRAINING, 1, 30.0)  # a 30 s first step (compilation, caches)
    for step in range(2, 12):
        clock.follow(TRAINING, step, 30.0 + (step - 1) * 2.0)  # then 2 s a step
    assert clock.rate() == pytest.approx(0.5)
    eta, basis = clock.eta(TRAINING, now=50.0, elapsed_s=50)
    assert (eta, basis) == (pytest.approx(178.0), "measured")
    # tqdm, averaging since the bar opened, would have said (100 - 11) * 50 / 11 = 404 s


def test_the_eta_includes_the_save_and_teardown_after_the_last_step():
    clock = training_clock(10, tail=25.0)
    for step in range(1, 6):
        clock.follow(TRAINING, step, 100.0 + 2.0 * step)
    eta, basis = clock.eta(TRAINING, now=110.0, elapsed_s=200)
    assert basis == "measured" and eta == pytest.approx(5 * 2.0 + 25.0)


def test_the_eta_is_measured_from_the_first_step_on():
    clock = training_clock(31, tail=5.0, estimate=900.0, opened=40.0)
    assert clock.eta(TRAINING, now=45.0, elapsed_s=45) == (855.0, "history")  # the first step is not done yet
    clock.follow(TRAINING, 1, 52.0)  # the first step took 12 s
    assert clock.rate() == pytest.approx(1 / 12)
    assert clock.eta(TRAINING, now=52.0, elapsed_s=52) == (pytest.approx(30 * 12.0 + 5.0), "measured")


def test_between_steps_the_eta_counts_down_and_never_below_the_tail():
    clock = training_clock(10, tail=8.0)
    clock.follow(TRAINING, 1, 104.0)
    clock.follow(TRAINING, 2, 108.0)  # 4 s a step: 8 steps and the tail left, 40 s
    assert clock.eta(TRAINING, now=108.0, elapsed_s=0)[0] == pytest.approx(40.0)
    assert clock.eta(TRAINING, now=111.0, elapsed_s=0)[0] == pytest.approx(37.0)
    assert clock.eta(TRAINING, now=200.0, elapsed_s=0)[0] == pytest.approx(8.0)  # a step that hangs: the tail


def test_during_the_final_save_the_tail_counts_down_to_zero():
    clock = training_clock(2, tail=6.0)
    clock.follow(TRAINING, 1, 102.0)
    clock.follow(Phase.SAVING, 2, 104.0)
    assert clock.eta(Phase.SAVING, now=104.0, elapsed_s=0) == (pytest.approx(6.0), "measured")
    assert clock.eta(Phase.SAVING, now=108.5, elapsed_s=0) == (pytest.approx(1.5), "measured")
    assert clock.eta(Phase.SAVING, now=130.0, elapsed_s=0) == (0.0, "measured")


def test_before_training_the_eta_is_the_history_estimate_and_says_so():
    clock = EtaClock(total_steps=400, estimated_duration_s=600.0, tail_s=12.0)
    assert clock.eta(Phase.LOADING_MODEL, now=0.0, elapsed_s=100) == (500.0, "history")
    # overdue: still the save and teardown to come
    assert clock.eta(Phase.LOADING_MODEL, now=0.0, elapsed_s=900) == (12.0, "history")
    assert EtaClock(400, None).eta(Phase.LOADING_MODEL, now=0.0, elapsed_s=10) == (None, None)


def test_the_tail_is_the_median_of_finished_jobs_or_the_default():
    assert estimate_tail([]) == DEFAULT_TAIL_S
    assert estimate_tail([4.0, 9.0, 5.0]) == 5.0
    assert EtaClock(10, None).tail_s == DEFAULT_TAIL_S


def test_a_clock_moves_with_time_only_when_it_has_something_to_count_down():
    assert not EtaClock(10, None).moves()
    assert EtaClock(10, 300.0).moves()
    clock = training_clock(10)
    assert not clock.moves()
    clock.follow(TRAINING, 1, 103.0)
    assert clock.moves()


# -- the real captures, replayed with their timing --------------------------------------------------------------

def dense(name: str, history: str) -> tuple[Capture, list]:
    capture = Capture.load(name)
    estimate, tail = histories(capture)[history]
    return capture, replay(capture, estimate=estimate, tail_s=tail,
                           at=[i * 0.25 for i in range(1, int(capture.end_s / 0.25))])


@pytest.mark.parametrize("name", RUNS)
def test_on_the_real_runs_the_eta_is_measured_from_the_first_step(name):
    _, samples = dense(name, "warm")
    stepped = [s for s in samples if s.step >= 1]
    assert stepped and all(s.basis == "measured" for s in stepped)
    assert all(s.basis == "history" for s in samples if s.step == 0)


@pytest.mark.parametrize("name", RUNS)
def test_on_the_real_runs_the_eta_counts_down_between_steps(name):
    _, samples = dense(name, "warm")
    pairs = [(a, b) for a, b in zip(samples, samples[1:]) if a.step == b.step >= 1 and b.eta > 0]
    assert len(pairs) > 20
    for a, b in pairs:
        assert b.eta == pytest.approx(a.eta - (b.t - a.t), abs=1e-6) or b.eta == a.eta == 0, (a, b)


@pytest.mark.parametrize("name", RUNS)
def test_on_the_real_runs_the_eta_covers_the_save_and_teardown(name):
    capture, samples = dense(name, "warm")
    final = [s for s in samples if s.phase is Phase.SAVING and s.step == max(x.step for x in samples)]
    assert final and all(abs(s.eta - s.left) < 0.5 for s in final)
    # and the cold default, though pessimistic on this small CPU run, still promises a wait after the last step
    _, cold = dense(name, "cold")
    assert all(s.eta > 0 for s in cold if s.phase is Phase.SAVING and s.left > 0.5)


@pytest.mark.parametrize("name", RUNS)
def test_on_the_real_runs_the_measured_eta_is_within_a_step_of_the_truth(name):
    """The figures in docs/benchmarks.md: at 50 and 90 % of each run, with a previous job as history, the ETA
    is off by less than one step's time (run1 11 s a step, run5 4 s)."""
    capture = Capture.load(name)
    estimate, tail = histories(capture)["warm"]
    step_s = {"run1_simple": 11.3, "run5_epochs_saves": 3.8}[name]
    for s in replay(capture, estimate=estimate, tail_s=tail, at=[capture.end_s * f for f in (0.5, 0.9)]):
        assert s.eta is not None and abs(s.eta - s.left) < step_s, s


def test_the_estimate_is_the_median_of_similar_jobs_or_nothing():
    assert estimate_duration([]) is None
    assert estimate_duration([100.0, 400.0, 130.0]) == 130.0


def seed_history(db, durations: list[float], tail_s: float | None = None, status: JobState = JobState.SUCCEEDED,
                 **match: object) -> None:
    """Finished jobs that took `durations`; with `tail_s`, their last step came that long before the end."""
    for seconds in durations:
        job = repo.create_job(db, columns(**match))
        start = utcnow() - timedelta(hours=2)
        end = start + timedelta(seconds=seconds)
        repo.transition(db, job.id, JobState.RUNNING, actor="seed", started_at=start)
        if tail_s is not None:
            repo.update_running(db, job.id, points=[(1, 1.0, start + timedelta(seconds=1)),
                                                    (job.total_steps, 0.5, end - timedelta(seconds=tail_s))])
        repo.transition(db, job.id, status, actor="seed", finished_at=end)


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


@pytest.mark.slow
def test_the_running_eta_is_history_before_training_then_measured_with_the_learned_tail(client, host, db):
    seed_history(db, [120.0], tail_s=30.0, tier="fast", device_index=1, image_count=3)
    seed_history(db, [500.0], tail_s=300.0, tier="fast", device_index=0)  # another device: another tail
    seed_history(db, [500.0], tail_s=300.0, status=JobState.FAILED, tier="fast", device_index=1)  # not a finish
    modes(host, load_s=1.0, step_s=0.02)
    job_id = submit(client, host, samples=[])  # no sample passes: test_sample_passes_* count those
    loading = wait_phase(client, job_id, "loading_model")
    assert loading["eta_basis"] == "history" and 100 < loading["eta_s"] <= 120
    later = wait_for(lambda: (j := job(client, job_id))["eta_s"] < loading["eta_s"] and j, what="countdown")
    assert later["eta_basis"] == "history"
    training = wait_for(lambda: (j := job(client, job_id))["eta_basis"] == "measured" and j, what="measured eta")
    assert training["phase"] in ("training", "saving") and training["rate"] > 10  # 0.02 s a step
    remaining = training["total_steps"] - training["step"]
    # the steps left at the measured rate, and the 30 s that jobs of this tier and device took after their last
    # step, less the fraction of a second since the newest step
    assert training["eta_s"] == pytest.approx(remaining / training["rate"] + 30.0, abs=1.0)
    done = wait_state(client, job_id, *TERMINAL)
    assert done["status"] == "succeeded" and done["training_started_at"] >= done["started_at"]
    assert (done["eta_s"], done["eta_basis"]) == (None, None)


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


def test_the_tail_history_is_finish_minus_the_time_the_last_step_was_first_written(db):
    seed_history(db, [200.0], tail_s=7.0, tier="balanced", device_index=1)
    seed_history(db, [200.0], tail_s=None, tier="balanced", device_index=1)  # no loss curve: nothing to learn
    assert repo.save_and_teardown_durations(db, backend="local", tier="balanced", device_index=1) == [
        pytest.approx(7.0, abs=0.01)]
    assert repo.save_and_teardown_durations(db, backend="local", tier="quality", device_index=1) == []


def test_a_step_written_again_keeps_its_first_time_and_takes_the_new_loss(db):
    """The bar's close repeats the last step after the save and teardown; that must not move the step's time
    (the tail history would shrink to nothing)."""
    job_id = repo.create_job(db, columns()).id
    repo.transition(db, job_id, JobState.RUNNING, actor="test", started_at=utcnow())
    first = utcnow() - timedelta(seconds=9)
    repo.update_running(db, job_id, points=[(400, 0.9, first)])
    repo.update_running(db, job_id, points=[(400, 0.8, utcnow())])
    (point,) = repo.progress_points(db, job_id)
    assert point.loss == 0.8 and abs((point.at - first).total_seconds()) < 0.002


@pytest.mark.slow
def test_the_eta_replay_benchmark_runs_and_prints_its_tables():
    import subprocess
    import sys

    from lora_worker.config import REPO_ROOT

    out = subprocess.run([sys.executable, "-m", "bench.eta_replay", "--quick"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "### ETA on the real captures" in out.stdout and "| run1_simple (80 s) | warm | 90% |" in out.stdout

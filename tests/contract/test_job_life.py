"""The life of a job, one contract for every backend: each scenario runs on the local supervisor and on Slurm
(tests/helpers/life.py: the fake trainer under the real detached supervisor, and under the fake Slurm's tools with
the real detached poller) and asserts one expected end for both: the row's status, failure class and phase, its
LoRA, its events, its webhook bodies and the files in its output directory. A backend that answers differently
fails it. What the two do differently by design (a killed or stopped follower: a supervisor's job cannot outlive
it, a Slurm job goes on without its poller) is said where it is, next to what they still share.
"""
from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker.ledger import outbox
from tests.helpers import Host
from tests.helpers.life import (BACKENDS, TO_TRAINING, End, Worker, end_of, hooks, phase_hooks, phases,
                                start_worker)
from tests.helpers.runs import wait_states_removed
from tests.webhooks.receiver import Receiver, write_secrets

pytestmark = pytest.mark.slow  # every scenario starts a trainer, a supervisor or a poller, and a sender

Start = Callable[..., Worker]
LORA = "ohwx_lora.safetensors"
PARTIAL = f"{LORA}.partial-<id>"
STEP_300 = "ohwx_lora-step00000300.safetensors"
QUEUED = ((outbox.QUEUED, "queued"),)
STARTED = ((outbox.QUEUED, "queued"), (outbox.STARTED, "running"))
RAN = (("", "queued"), ("queued", "running"))
NEVER = str(Path("/nonexistent") / "release")  # a release file that never comes: the trainer holds its step


@pytest.fixture(params=BACKENDS)
def start(request: pytest.FixtureRequest, host: Host, receiver: Receiver, secret: str,
          tmp_path: Path) -> Iterator[Start]:
    made: list[Worker] = []

    def make(**overrides: object) -> Worker:
        made.append(start_worker(request.param, host, tmp_path, receiver.url,
                                 write_secrets(tmp_path / "webhook_secret", secret), **overrides))  # type: ignore[arg-type]
        return made[-1]
    yield make
    for worker in made:
        worker.close()


def end(status: str, failure: str | None, phase: str | None, *, upto: tuple[str, ...] = TO_TRAINING,
        lora: bool = False, notes: tuple = (), checkpoints: tuple = (), files: tuple[str, ...] = ()) -> End:
    """The end of a job that ran through the phases `upto`."""
    return End(status, failure, phase, lora, RAN + phases(*upto) + notes + (("running", status),),
               STARTED + phase_hooks(*upto) + ((f"job.{status}", status, failure, lora, lora),) + checkpoints,
               files)


SAVES = ("saving", "training", "saving", "training", "saving")  # the step saves at 150 and 300, the final save
STEP_LORAS = (("job.checkpoint", 150, True, False), ("job.checkpoint", 300, True, False))
STATES = ("ohwx_lora-state", "ohwx_lora-step00000300-state")  # kept for a resume unless the job succeeded
MOVED = (("note", "LoRA moved aside"),)
ASKED = (("note", "cancel requested"),)  # the client's cancel, on the row before the job ends
SUCCESS = end("succeeded", None, "saving", upto=TO_TRAINING + SAVES, lora=True, checkpoints=STEP_LORAS,
              files=(STEP_300, LORA))


def held(worker: Worker, job_id: int, step: int) -> None:
    worker.wait(job_id, f"step {step}", lambda j: j["step"] >= step and j["status"] == "running")


# -- a run ------------------------------------------------------------------------------------------------------

def test_a_run_ends_succeeded_with_its_verified_lora_and_its_states_dropped(start: Start):
    worker = start()
    worker.modes()
    job_id = worker.submit()
    worker.wait_end(job_id)
    wait_states_removed(Path(worker.job(job_id)["lora_path"]).parent)
    assert end_of(worker, job_id) == SUCCESS
    assert worker.job(job_id)["step"] == 400


def test_a_loss_gone_nan_stops_the_run_and_fails_it_nan_loss(start: Start):
    """A NaN loss at step 5: the run is stopped (the trainer would go on to save a LoRA of NaN weights whose
    header verifies) and fails nan_loss, on Slurm as locally."""
    worker = start()
    worker.modes(nan_from_step=5, hold_at_step=20, release_file=NEVER)
    job_id = worker.submit()
    row = worker.wait_end(job_id)
    assert end_of(worker, job_id) == end("failed", "nan_loss", "training")
    assert row["error"].startswith("The loss became NaN at step 5") and 5 <= row["step"] < 20


@pytest.mark.parametrize("phase, modes, limit", [
    ("loading_model", {"hang_in": "loading_model"}, {"loading_model": 2.0}),
    ("training", {"hold_at_step": 3, "release_file": NEVER}, {"training": 2.0}),
])
def test_a_phase_silent_past_its_limit_is_stopped_and_fails_stalled(start: Start, phase, modes, limit):
    worker = start(stall_limits_s=limit)
    worker.modes(**modes)
    job_id = worker.submit()
    row = worker.wait_end(job_id)
    upto = TO_TRAINING[:TO_TRAINING.index(phase) + 1]
    assert end_of(worker, job_id) == end("failed", "stalled", phase, upto=upto)
    assert f"No progress in phase {phase} within its limit" in row["error"]


# -- a client's cancel, in each phase ---------------------------------------------------------------------------

def test_a_cancel_of_a_queued_job_ends_it_cancelled_and_nothing_runs(start: Start):
    worker = start(queue=True)  # nothing starts it: no supervisor locally, PENDING on Slurm
    worker.modes()
    job_id = worker.submit()
    worker.cancel(job_id)
    worker.wait_end(job_id)
    # The one difference of the backends: a local queued job is cancelled at once (nothing has started it), a
    # Slurm one is flagged (a node may start it any moment) and cancelled once Slurm says it ended.
    done = end_of(worker, job_id)
    assert (ASKED[0] in done.events) == (worker.backend == "slurm")
    assert replace(done, events=tuple(e for e in done.events if e not in ASKED)) == End(
        "cancelled", None, None, False, (("", "queued"), ("queued", "cancelled")),
        QUEUED + (("job.cancelled", "cancelled", None, False, False),), ())


@pytest.mark.parametrize("phase, modes", [
    ("loading_model", {"hang_in": "loading_model"}),
    ("caching_latents", {"hang_in": "caching_latents"}),
    ("training", {"hold_at_step": 3, "release_file": NEVER}),
])
def test_a_cancel_in_a_running_phase_stops_the_trainer_and_ends_cancelled(start: Start, phase, modes):
    worker = start()
    worker.modes(**modes)
    job_id = worker.submit()
    worker.wait_phase(job_id, phase)
    worker.cancel(job_id)
    worker.wait_end(job_id)
    upto = TO_TRAINING[:TO_TRAINING.index(phase) + 1]
    assert end_of(worker, job_id) == end("cancelled", None, phase, upto=upto, notes=ASKED)


def test_a_cancel_in_saving_ends_cancelled_and_sets_the_half_written_lora_aside(start: Start):
    worker = start()
    worker.modes(partial_save_then_hang=True)
    job_id = worker.submit()
    lora = Path(worker.job(job_id)["output_dir"]) / LORA
    worker.wait(job_id, "half a LoRA, saving", lambda j: j["phase"] == "saving" and j["step"] == 400 and lora.exists())
    worker.cancel(job_id)
    worker.wait_end(job_id)
    assert end_of(worker, job_id) == end("cancelled", None, "saving", upto=TO_TRAINING + SAVES, notes=ASKED + MOVED,
                                         checkpoints=STEP_LORAS, files=(*STATES, STEP_300, PARTIAL))


# -- the trainer's own endings ---------------------------------------------------------------------------------

def test_a_trainer_that_crashes_fails_with_the_class_its_output_explains(start: Start):
    worker = start()
    worker.modes(crash_at_step=3)
    job_id = worker.submit()
    row = worker.wait_end(job_id)
    assert end_of(worker, job_id) == end("failed", "trainer_crashed", "training")
    assert row["exit_code"] == 1 and "CUDA error: an illegal memory access" in row["error"]


def test_exit_0_without_a_lora_is_no_success(start: Start):
    worker = start()
    worker.modes(skip_save=True)
    job_id = worker.submit()
    worker.wait_end(job_id)
    assert end_of(worker, job_id) == end("failed", "no_output", "training", upto=TO_TRAINING + SAVES[:4],
                                         checkpoints=STEP_LORAS, files=("ohwx_lora-step00000300-state", STEP_300))


def test_a_save_that_never_finishes_leaves_its_partial_lora_aside_and_blocks_no_retry(start: Start):
    """The final save hangs half written (a full disk, a hung mount): the saving phase's limit stops it; the
    half file is moved aside, so the same request again is accepted, not 422 output_exists."""
    worker = start(stall_limits_s={"saving": 2.0})
    worker.modes(partial_save_then_hang=True)
    job_id = worker.submit()
    worker.wait_end(job_id)
    assert end_of(worker, job_id) == end("failed", "stalled", "saving", upto=TO_TRAINING + SAVES, notes=MOVED,
                                         checkpoints=STEP_LORAS, files=(*STATES, STEP_300, PARTIAL))
    worker.modes(hang_in="launching")
    again = worker.submit()  # 202, not output_exists
    worker.cancel(again)
    worker.wait_end(again)


def test_a_step_lora_that_fails_verification_is_recorded_so_and_the_run_goes_on(start: Start):
    worker = start()
    worker.modes(step_metadata_overrides={"ss_steps": "7"})  # each step LoRA names the wrong step
    job_id = worker.submit()
    worker.wait_end(job_id)
    wait_states_removed(Path(worker.job(job_id)["output_dir"]))
    unverified = (("job.checkpoint", 150, False, True), ("job.checkpoint", 300, False, True))
    assert end_of(worker, job_id) == end("succeeded", None, "saving", upto=TO_TRAINING + SAVES, lora=True,
                                         checkpoints=unverified, files=(STEP_300, LORA))
    errors = {c["step"]: c["error"] for c in worker.job(job_id)["checkpoints"]}
    assert errors == {300: "ss_steps '7' instead of 300"}  # 150 was pruned: kept, it would say the same


# -- the follower itself: killed, restarted, stopped -------------------------------------------------------------

def assert_followed_once(worker: Worker, job_id: int, log_before: bytes, hooks_before: list) -> None:
    """What a follower's death never does, on any backend: rewrite the run log (or log a line twice), or send an
    event twice."""
    log = worker.log(job_id)
    assert log.startswith(log_before)
    for line in (b"loading model for process 0/1", b"import network module: networks.lora"):  # each said once
        assert log.count(line) == 1, line
    said = [h for h in hooks(worker, job_id) if h[0] != outbox.PROGRESS]
    assert said[:len([h for h in hooks_before if h[0] != outbox.PROGRESS])] == [
        h for h in hooks_before if h[0] != outbox.PROGRESS]
    once = [h for h in said if h[0] not in (outbox.PHASE,)]
    assert len(once) == len(set(once)), said
    assert [h[1] for h in said if h[0] == outbox.PHASE] == [
        e[1] for e in end_of(worker, job_id).events if e[0] == "phase"]


def test_a_follower_killed_mid_run_sends_no_event_twice_and_rewrites_no_log(start: Start, host: Host):
    """kill -9 of the job's follower in training. A supervisor's job cannot outlive it: the next request's
    reconcile stops the trainer and fails the job supervisor_lost. A Slurm job runs on without its poller: the
    next request's reconcile starts a poller again, which takes the job up where the log and the row say it is
    and follows it to its end. Either way each event is sent once, and the run log is only appended to."""
    worker = start()
    release = host.root / "release"
    worker.modes(hold_at_step=100, release_file=str(release))
    job_id = worker.submit()
    held(worker, job_id, 99)
    log_before, hooks_before = worker.log(job_id), hooks(worker, job_id)
    worker.followed_again(job_id, worker.signal_follower(job_id, signal.SIGKILL))
    release.touch()
    worker.wait_end(job_id)
    if worker.backend == "slurm":
        wait_states_removed(Path(worker.job(job_id)["output_dir"]))
        assert end_of(worker, job_id) == SUCCESS
    else:
        assert end_of(worker, job_id) == end("failed", "supervisor_lost", "training")
    assert_followed_once(worker, job_id, log_before, hooks_before)


def test_a_shutdown_of_the_service_is_never_a_clients_cancel(start: Start, host: Host):
    """SIGTERM to the follower's process (systemd stopping the service) in training, where a client's cancel ends
    the job cancelled on both backends (test_a_cancel_in_a_running_phase_…[training]). A shutdown never does:
    locally the supervisor stops its trainer and fails the job supervisor_signalled (a new try may pass); a Slurm
    job runs on and the next poller follows it to its own end."""
    worker = start()
    release = host.root / "release"
    worker.modes(hold_at_step=100, release_file=str(release))
    job_id = worker.submit()
    held(worker, job_id, 99)
    log_before, hooks_before = worker.log(job_id), hooks(worker, job_id)
    worker.followed_again(job_id, worker.signal_follower(job_id, signal.SIGTERM))
    release.touch()
    row = worker.wait_end(job_id)
    if worker.backend == "slurm":
        wait_states_removed(Path(row["output_dir"]))
        assert end_of(worker, job_id) == SUCCESS
    else:
        assert end_of(worker, job_id) == end("failed", "supervisor_signalled", "training")
    assert worker.job(job_id)["cancel_requested_at"] is None
    assert_followed_once(worker, job_id, log_before, hooks_before)

"""The life of a job, one contract for every backend: each scenario (tests/helpers/scenarios.py) runs on the local
supervisor and on Slurm (tests/helpers/life.py: the fake trainer under the real detached supervisor, and under the
fake Slurm's tools with the real detached poller) and asserts one expected end for both: the row's status, failure
class and phase, its LoRA, its events, its webhook bodies and the files in its output directory. A backend that
answers differently fails it. Where the two differ by design (a queued cancel, a killed or stopped follower: a
supervisor's job cannot outlive it, a Slurm job goes on without its poller) the scenario says so, and asserts each
side next to what they still share. tests/cluster/test_job_life.py runs a few of them on the real cluster.
"""
from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Host
from tests.helpers import scenarios
from tests.helpers.life import BACKENDS, Worker, start_worker
from tests.helpers.scenarios import NEVER, Start
from tests.webhooks.receiver import Receiver, write_secrets

pytestmark = pytest.mark.slow  # every scenario starts a trainer, a supervisor or a poller, and a sender


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


# -- a run ------------------------------------------------------------------------------------------------------

def test_a_run_ends_succeeded_with_its_verified_lora_and_its_states_dropped(start: Start):
    scenarios.success(start())


def test_the_samples_are_listed_with_their_step_loras_and_a_step_is_promoted(start: Start):
    scenarios.samples_listed_and_promoted(start())


def test_a_loss_gone_nan_stops_the_run_and_fails_it_nan_loss(start: Start):
    scenarios.nan_loss(start())


@pytest.mark.parametrize("phase, modes", [("loading_model", {"hang_in": "loading_model"}),
                                          ("sampling", {"hang_in": "sampling"}),
                                          ("training", {"hold_at_step": 3, "release_file": NEVER})])
def test_a_phase_silent_past_its_limit_is_stopped_and_fails_stalled(start: Start, phase, modes):
    scenarios.stall(start(stall_limits_s={phase: 2.0}), phase, modes)


# -- a client's cancel, in each phase ---------------------------------------------------------------------------

def test_a_cancel_of_a_queued_job_ends_it_cancelled_and_nothing_runs(start: Start):
    scenarios.cancel_queued(start(queue=True))


@pytest.mark.parametrize("phase, modes", [("loading_model", {"hang_in": "loading_model"}),
                                          ("caching_latents", {"hang_in": "caching_latents"}),
                                          ("sampling", {"hang_in": "sampling"}),
                                          ("training", {"hold_at_step": 3, "release_file": NEVER})])
def test_a_cancel_in_a_running_phase_stops_the_trainer_and_ends_cancelled(start: Start, phase, modes):
    scenarios.cancel_running(start(), phase, modes)


def test_a_cancel_in_saving_ends_cancelled_and_sets_the_half_written_lora_aside(start: Start):
    scenarios.cancel_saving(start())


def test_a_cancel_after_a_saved_state_removes_the_state(start: Start):
    scenarios.cancel_after_a_state(start())


# -- the trainer's own endings ---------------------------------------------------------------------------------

def test_a_trainer_that_crashes_fails_with_the_class_its_output_explains(start: Start):
    scenarios.crash(start())


def test_a_crash_after_a_saved_state_removes_the_state_no_resume_could_use(start: Start):
    scenarios.crash_after_a_state(start())


def test_exit_0_without_a_lora_is_no_success(start: Start):
    scenarios.no_lora(start())


def test_a_save_that_never_finishes_leaves_its_partial_lora_aside_and_blocks_no_retry(start: Start):
    scenarios.save_never_ends(start(stall_limits_s={"saving": 2.0}))


def test_a_step_lora_that_fails_verification_is_recorded_so_and_the_run_goes_on(start: Start):
    scenarios.step_lora_unverified(start())


# -- the follower itself -----------------------------------------------------------------------------------------

def test_a_follower_killed_mid_run_sends_no_event_twice_and_rewrites_no_log(start: Start):
    scenarios.follower_gone(start(), signal.SIGKILL)


def test_a_shutdown_of_the_service_is_never_a_clients_cancel(start: Start):
    """SIGTERM to the follower's process (systemd stopping the service), where a client's cancel ends the job
    cancelled on both backends (test_a_cancel_in_a_running_phase_…[training])."""
    scenarios.follower_gone(start(), signal.SIGTERM)

"""Stall watchdog: each phase has its own silence limit; a silent job is killed and marked stalled."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lora_worker import create_app
from lora_worker.config import DEFAULT_STALL_LIMITS_S
from tests.run.test_supervisor import TERMINAL, job_processes, modes, recorded, submit, wait_state

pytestmark = pytest.mark.slow


@pytest.fixture
def client_with_limits(migrated):
    apps = []

    def make(**limits: float):
        app = create_app(replace(migrated, stall_limits_s={**DEFAULT_STALL_LIMITS_S, **limits}))
        apps.append(app)
        return app.test_client()

    yield make
    for app in apps:
        app.extensions["lora_worker"].db.dispose()


@pytest.mark.parametrize("phase", list(DEFAULT_STALL_LIMITS_S))
def test_a_job_silent_past_its_phase_limit_is_killed_and_stalled(client_with_limits, host, phase):
    client = client_with_limits(**{phase: 0.6})
    modes(host, hang_in=phase)
    job_id = submit(client, host)
    rec = recorded(host)
    done = wait_state(client, job_id, *TERMINAL, timeout=20)
    assert (done["status"], done["failure_class"], done["phase"]) == ("failed", "stalled", phase), done
    sentence, _, log_lines = done["error"].partition("\n\n")  # repository.failure_text's shape
    assert f"phase {phase}" in sentence and log_lines
    assert job_processes(rec) == []


def test_a_long_quiet_phase_within_its_limit_is_not_a_stall(client_with_limits, host):
    client = client_with_limits(training=1.0)  # each step is quicker than the training limit
    modes(host, load_s=1.5, step_s=0.004)  # loading is silent past the training limit, but its own limit is long
    done = wait_state(client, submit(client, host), *TERMINAL)
    assert done["status"] == "succeeded", done


def test_training_without_a_new_step_is_a_stall_even_while_output_flows(client_with_limits, host):
    # The trainer keeps redrawing the same step (a hung step with a chatty bar): output is not progress.
    client = client_with_limits(training=0.8)
    modes(host, flood_bytes=10**12, step_s=0.001)
    done = wait_state(client, submit(client, host), *TERMINAL, timeout=20)
    assert (done["failure_class"], done["step"]) == ("stalled", 1)

"""Stall watchdog, end to end: a silent real trainer is killed and marked stalled. Each phase's limit, the
count from the trainer's start, and output versus progress are unit-tested in test_loop_rules.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lora_worker import create_app
from lora_worker.config import DEFAULT_STALL_LIMITS_S
from tests.helpers.runs import TERMINAL, job_processes, modes, recorded, submit, wait_state

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


@pytest.mark.parametrize("phase", ["caching_latents"])
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

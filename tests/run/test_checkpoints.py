"""Step checkpoints through the real local supervisor and the fake trainer (tier fast: 400 steps, a step LoRA and
a state every 100, one of each kept: the jobs draw no samples, which keep every sampled step LoRA,
tests/contract): each one recorded, each step LoRA verified, listed on GET /train/<id>, never taken for the job's
result."""
from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.helpers.runs import TERMINAL, job, modes, recorded, submit, wait_state, wait_states_removed

pytestmark = pytest.mark.slow


def rows(host, job_id: int) -> list[tuple]:
    conn = sqlite3.connect(host.settings.database_path)
    try:
        return conn.execute("SELECT kind, step, path, verified, error, removed_at IS NOT NULL FROM checkpoints "
                            "WHERE job_id = ? ORDER BY kind, step, path", (job_id,)).fetchall()
    finally:
        conn.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_save_is_recorded_and_the_kept_step_lora_is_verified_and_listed(client, host):
    modes(host)
    job_id = submit(client, host, samples=[])
    done = wait_state(client, job_id, *TERMINAL)
    assert done["status"] == "succeeded", done
    out = host.dataset.parent / "output"
    kept = out / "ohwx_lora-step00000400.safetensors"
    assert done["checkpoints"] == [{"step": 400, "path": str(kept), "bytes": kept.stat().st_size,
                                    "sha256": sha256(kept), "verified": True, "error": None}]
    assert done["lora_path"] == str(out / "ohwx_lora.safetensors")  # the final one, never a step LoRA
    recorded_rows = rows(host, job_id)
    loras, states = recorded_rows[:4], recorded_rows[4:]
    # the trainer removed the older LoRAs and states: marked removed, and never a failed verification
    for step, lora in zip((100, 200, 300), loras):
        assert lora[:3] == ("lora", step, str(out / f"ohwx_lora-step{step:08d}.safetensors")) and lora[5] == 1
        assert lora[3] in (1, None) and lora[4] is None
    assert loras[3] == ("lora", 400, str(kept), 1, None, 0)
    assert states[:3] == [("state", s, str(out / f"ohwx_lora-step{s:08d}-state"), None, None, 1)
                          for s in (100, 200, 300)]
    assert states[3:] == [("state", 400, str(out / "ohwx_lora-state"), None, None, 0),
                          ("state", 400, str(out / "ohwx_lora-step00000400-state"), None, None, 0)]
    # a verified success removes the states (docs/resume.md): nothing is left to resume, and they are large
    wait_states_removed(out)


def test_a_run_killed_after_a_step_save_fails_and_keeps_its_verified_step_lora(client, host):
    release = host.root / "release"
    modes(host, hold_at_step=150, release_file=str(release))
    job_id = submit(client, host, samples=[])
    rec = recorded(host)
    listed = wait_for(lambda: (j := job(client, job_id))["checkpoints"] and j["checkpoints"][0]["verified"] is not None
                      and j, what="the step LoRA verified")
    assert [(c["step"], c["verified"]) for c in listed["checkpoints"]] == [(100, True)]
    os.kill(rec["pid"], signal.SIGKILL)
    done = wait_state(client, job_id, *TERMINAL)
    assert (done["status"], done["failure_class"], done["lora_path"]) == ("failed", "killed_by_signal", None)
    assert [(c["step"], c["verified"]) for c in done["checkpoints"]] == [(100, True)]
    assert not (host.dataset.parent / "output" / "ohwx_lora.safetensors").exists()


def test_a_step_lora_that_fails_verification_is_listed_so_and_the_job_succeeds(client, host):
    modes(host, step_metadata_overrides={"ss_steps": "7"})  # the step LoRAs' only: the final one is right
    job_id = submit(client, host, samples=[])
    done = wait_state(client, job_id, *TERMINAL)
    assert done["status"] == "succeeded", done
    [listed] = done["checkpoints"]
    assert (listed["step"], listed["verified"], listed["sha256"]) == (400, False, None)
    assert listed["error"] == "ss_steps '7' instead of 400"

"""The whole path on a fake Slurm's command-line tools (tests/slurm/fake_slurm): POST /train → sbatch → the
batch script runs the fake trainer → the real detached poller process follows it → the row. The real-cluster
tests (a single-node Slurm) exercise the same path against Slurm itself."""
from __future__ import annotations

from pathlib import Path

import pytest

from lora_worker.host.locks import lock_state
from lora_worker.ledger import repository as repo
from lora_worker.slurm.process import poller_lock_path
from tests.helpers import payload, set_modes, wait_for
from tests.slurm.fakes import cmdline as _cmdline

pytestmark = pytest.mark.slow  # every test here starts a real process



def test_a_job_dispatched_over_http_ends_succeeded_with_a_verified_lora(worker, host):
    client, db, settings = worker
    answer = client.post("/train", json=payload(host.dataset, host.model))
    assert answer.status_code == 202
    job_id = answer.get_json()["worker_job_id"]
    assert lock_state(poller_lock_path(settings)).held  # dispatch made sure the poller runs
    row = wait_for(lambda: (j := repo.get_job(db, job_id)).status in ("succeeded", "failed", "cancelled") and j,
                   timeout=60, what="the job to end")
    assert (row.status, row.backend, row.exit_code) == ("succeeded", "slurm", 0), row.error
    assert row.lora_sha256 and row.step == row.total_steps and repo.progress_points(db, job_id)
    body = client.get(f"/train/{job_id}").get_json()
    assert (body["status"], body["slurm_job_id"]) == ("succeeded", row.slurm_job_id)


def test_a_cancel_in_training_ends_cancelled_with_no_process_of_the_job_left(worker, host):
    client, db, settings = worker
    set_modes(settings.sd_scripts_dir, hold_at_step=3, release_file=str(host.root / "never"))
    answer = client.post("/train", json=payload(host.dataset, host.model))
    assert answer.status_code == 202, answer.get_json()
    job_id = answer.get_json()["worker_job_id"]
    wait_for(lambda: repo.get_job(db, job_id).step >= 1, timeout=60, what="training to reach step 1")
    token = f"--output_dir={repo.get_job(db, job_id).output_dir}"
    assert client.post(f"/train/{job_id}/cancel").status_code == 202
    row = wait_for(lambda: (j := repo.get_job(db, job_id)).status != "running" and j, timeout=60,
                   what="the job to end")
    assert row.status == "cancelled"
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and token.encode() in _cmdline(p)]
    assert left == []




def test_the_poller_records_and_verifies_the_step_loras_as_the_local_supervisor_does(worker, host):
    """The same transcript parts under Slurm: the node's log carries the saves, the poller records each one and
    verifies the kept step LoRA; GET /train/<id> lists it beside the final LoRA (no samples: one step LoRA kept)."""
    client, db, settings = worker
    answer = client.post("/train", json={**payload(host.dataset, host.model), "samples": []})
    assert answer.status_code == 202, answer.get_json()
    job_id = answer.get_json()["worker_job_id"]
    row = wait_for(lambda: (j := repo.get_job(db, job_id)).status in ("succeeded", "failed", "cancelled") and j,
                   timeout=60, what="the job to end")
    assert row.status == "succeeded", row.error
    out = Path(row.output_dir)
    body = client.get(f"/train/{job_id}").get_json()
    kept = out / f"{row.output_name}-step00000400.safetensors"
    assert [(c["step"], c["path"], c["verified"], c["bytes"]) for c in body["checkpoints"]] == [
        (400, str(kept), True, kept.stat().st_size)]
    assert body["lora_path"] == str(out / f"{row.output_name}.safetensors")
    seen = sorted((c.kind, c.step, c.removed_at is not None) for c in row.checkpoints)
    assert seen == [*(("lora", s, True) for s in (100, 200, 300)), ("lora", 400, False),
                    *(("state", s, True) for s in (100, 200, 300)), ("state", 400, False), ("state", 400, False)]

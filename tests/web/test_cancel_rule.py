"""The one rule of a cancel (states.CANCEL_RULE): the 202 body, the README and the OpenAPI document state it.
A trainer still running is stopped (tests/run: a cancel in `saving` ends `cancelled`, its partial LoRA moved
aside); one that had ended keeps its outcome, on both backends (tests/slurm/test_endings.py for Slurm)."""
from __future__ import annotations

from pathlib import Path

from lora_worker.ledger import repository as repo
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.states import CANCEL_RULE, JobState
from tests.helpers.ledger import columns

README = Path(__file__).resolve().parents[2] / "README.md"


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_202_body_the_readme_and_the_openapi_document_state_the_rule(api, host):
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    answer = api.post(f"/train/{job_id}/cancel")
    assert answer.status_code == 202 and answer.get_json()["cancel_rule"] == CANCEL_RULE
    assert CANCEL_RULE in flat(README.read_text())
    doc = api.get("/openapi.json").get_json()
    cancel = doc["paths"]["/train/{job_id}/cancel"]["post"]
    assert CANCEL_RULE in flat(cancel.get("description", "") + " " + cancel.get("summary", ""))
    schema = cancel["responses"]["202"]["content"]["application/json"]["schema"]
    name = schema["$ref"].rsplit("/", 1)[-1]
    assert "cancel_rule" in doc["components"]["schemas"][name]["properties"]


def test_a_trainer_that_ended_before_the_cancel_reached_it_keeps_its_success(db, migrated):
    """The trainer finished its save (exit 0, LoRA verified) before the supervisor saw the cancel: the job
    keeps the verified LoRA it made, and says so; nothing of it is thrown away."""
    job = repo.create_job(db, columns())
    assert repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    repo.request_cancel(db, job.id, actor="api")
    supervisor = SupervisorLedger(migrated.database_path)
    try:
        assert supervisor.mark_succeeded(job.id, reason="trainer finished and the LoRA verified",
                                         lora_path="/train/t1/output/ohwx.safetensors", lora_sha256="ab" * 32,
                                         lora_size=10, exit_code=0)
    finally:
        supervisor.close()
    done = repo.get_job(db, job.id)
    assert (done.status, done.lora_path, done.lora_sha256, done.lora_size, done.exit_code) == (
        "succeeded", "/train/t1/output/ohwx.safetensors", "ab" * 32, 10, 0)
    assert done.cancel_requested_at is not None  # the cancel is on record; it came too late to stop anything


def test_without_a_cancel_a_success_stays_a_success(db, migrated):
    job = repo.create_job(db, columns())
    assert repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    assert repo.transition(db, job.id, JobState.SUCCEEDED, actor="slurm", lora_path="/x.safetensors")
    assert repo.get_job(db, job.id).status == "succeeded"

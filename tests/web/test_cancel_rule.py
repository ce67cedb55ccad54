"""The one rule of a cancel (states.CANCEL_RULE): the 202 body, the README and the OpenAPI document state it,
and the ledger holds every ending to it: after a cancel was flagged, no job ends `succeeded`, though its
trainer finished the save first (the race a cancel during `saving` runs)."""
from __future__ import annotations

from pathlib import Path

from lora_worker.ledger import repository as repo
from lora_worker.ledger.statements import CANCEL_WINS
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.states import CANCEL_RULE, JobState
from tests.ledger.test_ledger import columns

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


def test_a_success_written_after_a_cancel_was_flagged_is_written_cancelled(db, migrated):
    """The trainer finished its save (exit 0, LoRA verified) as the cancel came: 202 was answered, so the job
    ends `cancelled`, and its LoRA is not reported."""
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
        "cancelled", None, None, None, 0)
    assert repo.job_events(db, job.id)[-1].reason == CANCEL_WINS


def test_without_a_cancel_a_success_stays_a_success(db, migrated):
    job = repo.create_job(db, columns())
    assert repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    assert repo.transition(db, job.id, JobState.SUCCEEDED, actor="slurm", lora_path="/x.safetensors")
    assert repo.get_job(db, job.id).status == "succeeded"

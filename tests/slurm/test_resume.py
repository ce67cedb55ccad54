"""Resume under Slurm, through the same parts as local: a new sbatch of the same sandboxed argv plus the resume
flags, progress counted on from the state's step; and a requeue is not a resume."""
from __future__ import annotations

import json
from pathlib import Path

from lora_worker.dispatch.auto_resume import follow_up
from lora_worker.ledger import repository as repo
from lora_worker.slurm.sbatch import spec_path
from lora_worker.states import FailureClass
from tests.helpers.states import interrupted
from tests.slurm.fakes import SlurmWorker, steps_bar


def spec_argv(slurm: SlurmWorker, job_id: int) -> list[str]:
    return json.loads(spec_path(slurm.settings, job_id).read_text())["job"]["argv"]


def test_a_resume_is_a_new_sbatch_of_the_same_argv_plus_the_resume_flags(slurm: SlurmWorker):
    job = slurm.submit()
    interrupted(slurm.db, slurm.settings, job.id, FailureClass.NODE_FAIL)
    answer = slurm.client.post(f"/train/{job.id}/resume")
    assert answer.status_code == 202, answer.get_json()
    new = repo.get_job(slurm.db, answer.get_json()["worker_job_id"])
    assert (new.backend, new.resumed_from, new.resume_step) == ("slurm", job.id, 4)
    assert new.slurm_job_id is not None and new.slurm_job_id != job.slurm_job_id
    state = f"{job.output_dir}/{job.output_name}-step00000004-state"
    original = spec_argv(slurm, job.id)
    assert original[-1] == "--sample_at_first"  # never a resume's: its state's weights are not the base model's
    assert spec_argv(slurm, new.id) == [*original[:-1], f"--resume={state}", "--skip_until_initial_step"]
    [prompts] = [a.split("=", 1)[1] for a in original if a.startswith("--sample_prompts=")]
    assert Path(prompts).parent == slurm.settings.slurm_logs / "prompts" and Path(prompts).is_file()  # the node's
    def same(sid: str) -> list[str]:  # the sbatch options but those naming the job itself
        return [o for o in slurm.scheduler.options[sid] if str(job.id) not in o and str(new.id) not in o]
    assert same(new.slurm_job_id) == same(job.slurm_job_id) and "--no-requeue" in same(new.slurm_job_id)
    # the steps bar of a resume counts the steps left from 0 (train_network.py L1357): the row counts on
    slurm.scheduler.set(new.slurm_job_id, "RUNNING")
    slurm.log(new, steps_bar(0, total=396) + steps_bar(6, total=396, loss=0.2))
    slurm.cycles()
    row = slurm.job(new.id)
    assert (row.status, row.step, row.total_steps) == ("running", 10, 400)


def test_a_requeue_is_not_a_resume(slurm: SlurmWorker):
    """A job Slurm requeued despite --no-requeue is stopped and failed node_fail by the poller; with
    auto_resume on, no resume row comes of it: only a reboot's cut-off job is resumed automatically."""
    slurm.settings = slurm.settings.with_overrides(auto_resume=True)
    job = slurm.submit()
    sid = job.slurm_job_id
    interrupted(slurm.db, slurm.settings, job.id, failure=None)
    slurm.scheduler.set(sid, "RUNNING")
    slurm.log(job, steps_bar(0) + steps_bar(5))
    slurm.cycles()
    slurm.scheduler.set(sid, "PENDING", "BeginTime")  # requeued
    slurm.cycles()
    slurm.scheduler.set(sid, "CANCELLED", code=0, signal=0, detail="CANCELLED by 0")
    slurm.cycles(2)
    assert slurm.job(job.id).failure_class == "node_fail"
    worker = slurm.client.application.extensions["lora_worker"]  # type: ignore[attr-defined]
    assert follow_up(worker.dispatcher) == []
    worker.reconcile_active()
    assert [j.id for j in repo.list_jobs(slurm.db)] == [job.id]
    assert repo.get_job(slurm.db, job.id).slurm_job_id == sid

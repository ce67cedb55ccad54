"""A Slurm job that Slurm itself ends mid-save (its time limit) leaves half a LoRA, as a local one cut short does: the
follower sets it aside on both backends (tests/contract/test_job_life.py has the cancel and the hung save), so the
same request is accepted again and the resumable ending can be resumed. Fake scheduler and a fake clock."""
from __future__ import annotations

from pathlib import Path

from lora_worker.ledger import repository as repo
from lora_worker.slurm.scheduler import SlurmJob
from tests.helpers.states import interrupted
from tests.slurm.fakes import SlurmWorker, steps_bar


def test_a_time_limit_in_the_save_sets_the_half_lora_aside_and_the_resume_is_not_refused(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    interrupted(slurm.db, slurm.settings, job.id, failure=None)  # its states at steps 2 and 4, as the run saved them
    lora = Path(job.lora_file)
    slurm.scheduler.set(sid, "RUNNING")
    slurm.log(job, "import network module: networks.lora\n" + steps_bar(0) + steps_bar(400)
              + f"\nsaving checkpoint: {lora}\n")
    lora.write_bytes(b"\0" * 4096)  # the save, cut by the limit: written in place, never finished
    slurm.cycles()
    assert slurm.job(job.id).phase == "saving"
    slurm.rc(job, -15)
    slurm.scheduler.set(sid, "TIMEOUT", code=0, signal=15, detail="TIMEOUT")
    slurm.scheduler.accounted[sid] = SlurmJob(sid, "TIMEOUT", None, 0, 15, detail="TIMEOUT")
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.failure_class, row.lora_path) == ("failed", "time_limit", None)
    aside = lora.with_name(f"{lora.name}.partial-{job.id}")
    assert not lora.exists() and aside.read_bytes() == b"\0" * 4096  # moved, never deleted
    assert any(f"moved aside to {aside.name}" in (e.reason or "") for e in repo.job_events(slurm.db, job.id)
               if e.from_status == e.to_status == "running")
    answer = slurm.client.post(f"/train/{job.id}/resume")  # not 409 lora_file_exists
    assert answer.status_code == 202, answer.get_json()
    assert slurm.client.post(f"/train/{answer.get_json()['worker_job_id']}/cancel").status_code == 202

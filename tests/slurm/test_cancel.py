"""A cancel on Slurm: the API flags the row; the poller scancels (TERM to every process, KILL after the grace,
a plain scancel while pending); the row is `cancelled` once Slurm says the job ended. A fake clock."""
from __future__ import annotations

from tests.slurm.fakes import SlurmWorker


def test_a_running_job_gets_term_then_kill_after_the_grace_then_is_cancelled_when_slurm_says_so(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "RUNNING")
    slurm.cycles()
    assert slurm.client.post(f"/train/{job.id}/cancel").status_code == 202
    slurm.cycles()
    assert slurm.scheduler.cancels() == [("scancel", "--signal=TERM", "--full", sid)]
    slurm.clock.now += slurm.settings.cancel_grace_s - 0.1
    slurm.cycles()
    assert len(slurm.scheduler.cancels()) == 1  # the grace is not over: no second signal, no repeat
    slurm.clock.now += 0.1
    slurm.cycles()
    assert slurm.scheduler.cancels()[1:] == [("scancel", "--signal=KILL", "--full", sid)]
    assert slurm.job(job.id).status == "running"  # until Slurm says the job ended
    slurm.clock.now += 10
    slurm.cycles()
    assert len(slurm.scheduler.cancels()) == 2
    slurm.scheduler.set(sid, "CANCELLED", code=0, signal=9, detail="CANCELLED by 0")
    slurm.cycles(2)
    assert slurm.job(job.id).status == "cancelled"


def test_a_trainer_that_obeys_term_gets_no_kill(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "RUNNING")
    slurm.client.post(f"/train/{job.id}/cancel")
    slurm.cycles()
    slurm.rc(job, -15)
    slurm.scheduler.set(sid, "CANCELLED", code=0, signal=15, detail="CANCELLED by 0")
    slurm.clock.now += slurm.settings.cancel_grace_s * 2
    slurm.cycles()
    assert slurm.scheduler.cancels() == [("scancel", "--signal=TERM", "--full", sid)]
    row = slurm.job(job.id)
    assert (row.status, row.signal) == ("cancelled", 15)


def test_a_pending_job_is_flagged_then_scancelled_plainly_and_cancelled_once_slurm_ends_it(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "PENDING", "Resources")
    answer = slurm.client.post(f"/train/{job.id}/cancel")
    assert answer.status_code == 202
    assert (answer.get_json()["status"], answer.get_json()["cancel_requested_at"] is not None) == ("queued", True)
    slurm.cycles(2)
    assert slurm.scheduler.cancels() == [("scancel", sid)]  # once
    assert slurm.job(job.id).status == "queued"  # it could still start: not cancelled before Slurm says so
    slurm.scheduler.set(sid, "CANCELLED", code=0, signal=0, detail="CANCELLED by 0")
    slurm.cycles(2)
    assert slurm.job(job.id).status == "cancelled"


def test_a_local_queued_job_is_still_cancelled_at_once(api, host):
    from tests.helpers import payload

    job_id = api.post("/train", json=payload(host.dataset, host.model)).get_json()["worker_job_id"]
    assert api.post(f"/train/{job_id}/cancel").get_json()["status"] == "cancelled"


def test_a_job_silent_past_its_phases_limit_is_stopped_and_failed_stalled(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "RUNNING")
    slurm.log(job, "loading model for process 0/1\n")
    slurm.cycles()
    limit = slurm.settings.stall_limits_s["loading_model"]
    slurm.clock.now += limit - 1
    slurm.log(job, "load StableDiffusion checkpoint: /models/sdxl_tiny.safetensors\n")  # life: the count restarts
    slurm.cycles()
    slurm.clock.now += limit - 1
    slurm.cycles()
    assert slurm.scheduler.cancels() == []
    slurm.clock.now += 2
    slurm.cycles()
    assert slurm.scheduler.cancels() == [("scancel", "--signal=TERM", "--full", sid)]
    slurm.clock.now += slurm.settings.cancel_grace_s
    slurm.cycles()
    assert slurm.scheduler.cancels()[1:] == [("scancel", "--signal=KILL", "--full", sid)]
    slurm.scheduler.set(sid, "CANCELLED", code=0, signal=9, detail="CANCELLED by 0")
    slurm.cycles(2)
    row = slurm.job(job.id)
    assert (row.status, row.failure_class) == ("failed", "stalled")
    assert "loading_model" in row.error

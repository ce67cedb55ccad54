"""The one ending rule, on Slurm: only an answer Slurm really gave settles a job; a row the worker ends while
Slurm may still run the job is scancelled first; a job that completed before its cancel was delivered keeps
its own outcome; a restarted poller appends to the run log and counts elapsed time from the row's start.
Fake tools throughout: none of these needs a cluster."""
from __future__ import annotations

import subprocess
from datetime import timedelta

import pytest
from sqlalchemy import update

from lora_worker.ledger import repository as repo
from lora_worker.ledger.models import Job, utcnow
from lora_worker.slurm import scheduler as scheduler_module
from lora_worker.slurm.poller import UNKNOWN_CYCLES
from lora_worker.slurm.sbatch import log_path
from lora_worker.slurm.scheduler import Result, Scheduler, SchedulerUnavailable, SlurmJob
from lora_worker.states import FailureClass
from lora_worker.transcript.logreader import LogReader
from tests.slurm.fakes import SlurmWorker, steps_bar
from tests.slurm.fakes import run_batch_script

TRAINING = "loading model for process 0/1\nimport network module: networks.lora\n" + steps_bar(0) + steps_bar(50)


class Answers:
    def __init__(self, *results: Result) -> None:
        self.results = list(results)
        self.argvs: list[list[str]] = []

    def __call__(self, argv: list[str]) -> Result:
        self.argvs.append(argv)
        return self.results.pop(0)


# -- only an answer Slurm really gave ---------------------------------------------------------------------

def test_an_empty_squeue_answer_for_a_job_is_no_answer_not_gone():
    """exit 0 and no line: an SQUEUE_* filter in the environment, or a client that answered nothing."""
    with pytest.raises(SchedulerUnavailable, match="answered nothing"):
        Scheduler(run=Answers(Result(0, "", ""))).queue(["5"])


def test_an_empty_answer_for_several_jobs_is_asked_again_job_by_job():
    run = Answers(Result(0, "", ""), Result(0, "7|RUNNING|None\n", ""),
                  Result(1, "", "slurm_load_jobs error: Invalid job id specified"))
    assert set(Scheduler(run=run).queue(["7", "8"])) == {"7"}  # 8: Slurm said it does not know it
    assert [a[3] for a in run.argvs] == ["--jobs=7,8", "--jobs=7", "--jobs=8"]


def test_an_unparsable_squeue_line_is_no_answer():
    with pytest.raises(SchedulerUnavailable, match="cannot read"):
        Scheduler(run=Answers(Result(0, "JOBID STATE REASON\n", ""))).queue(["5"])


def test_slurm_commands_run_without_the_callers_filters(monkeypatch):
    seen = {}

    def fake_run(argv, **kwargs):
        seen.update(kwargs["env"])
        return subprocess.CompletedProcess(argv, 0, "5|RUNNING|None\n", "")

    for name in ("SQUEUE_USERS", "SACCT_FORMAT", "SLURM_TIME_FORMAT", "SQUEUE_STATES"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    monkeypatch.setattr(scheduler_module.subprocess, "run", fake_run)
    assert set(Scheduler().queue(["5"])) == {"5"}
    assert not {k for k in seen if k.startswith(("SQUEUE_", "SACCT_", "SLURM_TIME"))}
    assert seen["SLURM_CONF"] == "/etc/slurm/slurm.conf"  # which cluster is still the caller's to say


def test_a_state_word_this_worker_does_not_know_ends_nothing(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.cycles()
    slurm.scheduler.set(job.slurm_job_id, "POWER_UP_NODE")  # sacct says the same: no known ending anywhere
    slurm.cycles(UNKNOWN_CYCLES + 2)
    assert slurm.job(job.id).status == "running" and slurm.scheduler.cancels() == []


def test_when_sacct_is_down_scontrols_invalid_job_id_settles_nothing(slurm: SlurmWorker):
    """A TIMEOUT job slurmctld has forgotten: its .rc says SIGTERM, only accounting knows it was the limit."""
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "RUNNING")
    slurm.log(job, TRAINING)
    slurm.cycles()
    slurm.rc(job, -15)
    del slurm.scheduler.jobs[sid]  # squeue and scontrol: "Invalid job id"
    slurm.scheduler.sacct_down = True
    slurm.cycles(UNKNOWN_CYCLES + 2)
    assert slurm.job(job.id).status == "running"
    slurm.scheduler.sacct_down = False
    slurm.scheduler.accounted[sid] = SlurmJob(sid, "TIMEOUT", None, 0, 0, detail="TIMEOUT")
    slurm.cycles()
    assert (slurm.job(job.id).status, slurm.job(job.id).failure_class) == ("failed", "time_limit")


# -- a row the worker ends while Slurm may still run the job is scancelled first ---------------------------

def test_a_job_slurm_lists_nowhere_is_scancelled_before_its_row_ends(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "RUNNING")
    slurm.cycles()
    del slurm.scheduler.jobs[sid]
    del slurm.scheduler.accounted[sid]
    status_at_cancel = []
    real_cancel = slurm.scheduler.cancel

    def cancel(job_id, signal=None):
        status_at_cancel.append(slurm.job(job.id).status)
        real_cancel(job_id, signal)

    slurm.scheduler.cancel = cancel
    slurm.cycles(UNKNOWN_CYCLES)
    assert (slurm.job(job.id).status, slurm.job(job.id).failure_class) == ("failed", "slurm_lost")
    assert slurm.scheduler.cancels() == [("scancel", sid)] and status_at_cancel == ["running"]


def test_a_row_ended_elsewhere_while_slurm_runs_its_job_gets_the_job_scancelled(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.cycles()
    assert repo.fail_job(slurm.db, job.id, actor="cli", failure_class=FailureClass.SUPERVISOR_LOST,
                         sentence="An operator failed it")
    slurm.cycles()
    assert slurm.scheduler.cancels() == [("scancel", job.slurm_job_id)]


def test_reconcile_scancels_an_unattended_slurm_job_before_failing_its_row(slurm: SlurmWorker):
    from lora_worker.errors import LaunchFailed
    from lora_worker.reconcile import reconcile
    from lora_worker.slurm.backend import SlurmBackend

    def cannot_start(settings):
        raise LaunchFailed("no poller today")

    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.cycles()
    del slurm.scheduler.jobs[job.slurm_job_id]  # squeue lists it nowhere: nobody attends it
    backend = SlurmBackend(scheduler=slurm.scheduler, start_poller=cannot_start, db=slurm.db)
    slurm.scheduler.down = True  # ... and scancel cannot make sure it stopped: the row is left for later
    assert reconcile(slurm.db, slurm.settings, backend=backend) == [] and slurm.job(job.id).status == "running"
    slurm.scheduler.down = False
    slurm.scheduler.calls.clear()
    [action] = reconcile(slurm.db, slurm.settings, backend=backend)
    assert action.job_id == job.id and slurm.job(job.id).status == "failed"
    assert slurm.scheduler.cancels() == [("scancel", job.slurm_job_id)]


# -- a job that completed before its cancel was delivered keeps its own outcome ---------------------------

@pytest.mark.slow
def test_a_job_that_completed_before_its_cancel_reached_it_keeps_its_success(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "RUNNING")
    assert run_batch_script(slurm.scheduler.scripts[sid], slurm.scheduler.args[sid],
                            log_path(slurm.settings, job.id)) == 0
    slurm.scheduler.set(sid, "COMPLETED", code=0, signal=0)
    assert slurm.client.post(f"/train/{job.id}/cancel").status_code == 202  # between two cycles
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.failure_class, len(row.lora_sha256 or "")) == ("succeeded", None, 64)
    assert slurm.scheduler.cancels() == []  # nothing left to stop


# -- a restarted poller ----------------------------------------------------------------------------------

def test_a_restarted_poller_appends_to_the_run_log_and_offsets_never_go_back(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, TRAINING)
    slurm.cycles()
    before = (slurm.settings.log_dir / f"job-{job.id}.log").read_bytes()
    size = LogReader(slurm.settings.log_dir, job.id).size()
    slurm.new_poller()
    slurm.log(job, steps_bar(60, loss=0.4) + "\n")
    slurm.cycles()
    after = (slurm.settings.log_dir / f"job-{job.id}.log").read_bytes()
    assert after.startswith(before) and LogReader(slurm.settings.log_dir, job.id).size() > size
    assert after.count(b"50/400") == 1 and b"60/400" in after[len(before):]  # nothing logged twice
    assert not list(slurm.settings.log_dir.glob("*replaced*"))  # the old log was not moved aside
    assert (slurm.job(job.id).step, slurm.job(job.id).loss) == (60, 0.4)


def test_a_restarted_poller_takes_elapsed_time_from_the_rows_start(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, "loading model for process 0/1\n")
    slurm.cycles()
    with slurm.db.write() as s:  # it has run for 1000 s of an expected 3000
        s.execute(update(Job).where(Job.id == job.id).values(started_at=utcnow() - timedelta(seconds=1000),
                                                            estimated_duration_s=3000.0))
    slurm.new_poller()
    slurm.cycles()
    row = slurm.job(job.id)
    assert row.eta_basis == "history" and row.eta_s == pytest.approx(2000, abs=5)


def test_an_ended_jobs_log_offset_record_goes_with_it(slurm: SlurmWorker):
    from lora_worker.slurm.nodelog import offset_path

    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, TRAINING)
    slurm.cycles()
    assert offset_path(slurm.settings, job.id).read_text().strip() == str(len(TRAINING.encode()))
    slurm.rc(job, 3)
    slurm.scheduler.set(job.slurm_job_id, "FAILED", code=3, signal=0)
    slurm.cycles()
    assert slurm.job(job.id).status == "failed" and not offset_path(slurm.settings, job.id).exists()

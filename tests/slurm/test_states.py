"""Every row of the Slurm reference's state table, through the poller, to the row's state and class.

The jobs are dispatched for real (POST /train on a worker with backend = "slurm"); Slurm is a FakeScheduler
answering with the states the reference observed; the log and `.rc` files are what the node would write."""
from __future__ import annotations

import os

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.slurm.poller import UNKNOWN_CYCLES
from lora_worker.slurm.sbatch import log_path, rc_path
from tests.slurm.fakes import SlurmWorker, steps_bar
from tests.helpers import set_modes
from tests.slurm.fakes import run_batch_script, with_argv

TRAINING_LOG = ("loading model for process 0/1\ncaching latents...\nimport network module: networks.lora\n"
                + steps_bar(0) + steps_bar(120, loss=0.3) + steps_bar(121, loss=0.29))


def test_pending_keeps_the_row_queued_with_slurms_reason(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    assert (job.status, job.backend, job.slot, sid) == ("queued", "slurm", "slurm-0", "1001")
    slurm.scheduler.set(sid, "PENDING", "Resources")
    slurm.cycles()
    first = slurm.job(job.id)
    assert (first.status, first.queue_reason) == ("queued", "Resources")
    slurm.scheduler.set(sid, "PENDING", "Priority")
    slurm.cycles()
    again = slurm.job(job.id)
    assert (again.status, again.queue_reason) == ("queued", "Priority")
    assert again.version > first.version  # a long poll sees the new reason
    slurm.cycles()
    assert slurm.job(job.id).version == again.version  # nothing new, nothing written


def test_running_makes_the_row_running_with_progress_from_the_log(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, TRAINING_LOG)
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.phase, row.step, row.total_steps, row.loss, row.queue_reason) == (
        "running", "training", 121, 400, 0.29, None)
    assert row.started_at is not None
    body = slurm.client.get(f"/train/{job.id}").get_json()
    assert (body["backend"], body["slurm_job_id"], body["queue_reason"]) == ("slurm", job.slurm_job_id, None)


@pytest.mark.slow
def test_completed_with_a_verified_lora_is_succeeded(slurm: SlurmWorker):
    """The batch script itself runs the job's stored argv (the fake trainer) as a node would."""
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "RUNNING")
    assert run_batch_script(slurm.scheduler.scripts[sid], slurm.scheduler.args[sid],
                            log_path(slurm.settings, job.id)) == 0
    slurm.scheduler.set(sid, "COMPLETED", code=0, signal=0)
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.exit_code, row.failure_class) == ("succeeded", 0, None)
    assert row.lora_path == job.lora_file and len(row.lora_sha256) == 64 and row.lora_size > 0
    assert row.step == row.total_steps > 0
    run_log = (slurm.settings.log_dir / f"job-{job.id}.log").read_text()
    assert "model saved." in run_log  # the run log carries the trainer's output, as for a local job


def test_completed_without_a_lora_is_failed_no_output(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.log(job, TRAINING_LOG + "\nmodel saved.\n")  # claims a save, wrote nothing
    slurm.rc(job, 0)
    slurm.scheduler.set(job.slurm_job_id, "COMPLETED", code=0, signal=0)
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.failure_class) == ("failed", "no_output")


@pytest.mark.slow
def test_failed_takes_its_class_from_the_log(slurm: SlurmWorker):
    """The fake trainer runs out of CUDA memory at step 2, through the batch script, as on a node."""
    set_modes(slurm.settings.sd_scripts_dir, oom_at_step=2)
    job = slurm.submit()
    sid = job.slurm_job_id
    assert run_batch_script(slurm.scheduler.scripts[sid], slurm.scheduler.args[sid],
                            log_path(slurm.settings, job.id)) == 1
    slurm.scheduler.set(sid, "FAILED", code=1, signal=0)
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.failure_class, row.exit_code) == ("failed", "cuda_oom", 1)
    assert "CUDA out of memory" in row.error


def test_exit_3_is_a_trainer_crash_with_status_3(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.rc(job, 3)
    slurm.scheduler.set(job.slurm_job_id, "FAILED", code=3, signal=0)
    slurm.cycles()
    assert (slurm.job(job.id).failure_class, slurm.job(job.id).exit_code) == ("trainer_crashed", 3)


@pytest.mark.slow
def test_exit_200_is_recorded_as_200_not_saccts_truncated_72(slurm: SlurmWorker):
    job = slurm.submit()
    sid = job.slurm_job_id
    # The stored argv, replaced by one that exits 200, through the generated script as a node runs it.
    with_argv(slurm.settings, job.id, ["/bin/sh", "-c", "exit 200"])
    assert run_batch_script(slurm.scheduler.scripts[sid], slurm.scheduler.args[sid],
                            log_path(slurm.settings, job.id)) == 1
    slurm.scheduler.set(sid, "FAILED", code=72, signal=0)
    slurm.cycles()
    assert (slurm.job(job.id).exit_code, slurm.job(job.id).failure_class) == (200, "trainer_crashed")


@pytest.mark.parametrize("signal", [9, 15])
def test_a_kill_from_outside_or_from_the_batch_script_is_killed_by_signal(slurm: SlurmWorker, signal: int):
    """FAILED 0:9 (an outside SIGKILL) and FAILED 0:15 (the script's own SIGTERM): not CANCELLED."""
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, TRAINING_LOG)
    slurm.cycles()
    slurm.scheduler.set(job.slurm_job_id, "FAILED", code=0, signal=signal)
    slurm.cycles(2)  # no .rc: the ending is read once it has settled, a cycle later
    row = slurm.job(job.id)
    assert (row.status, row.failure_class, row.signal) == ("failed", "killed_by_signal", signal)


def test_cancelled_by_someone_else_is_failed_killed_by_signal_naming_slurm(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.cycles()
    slurm.scheduler.set(job.slurm_job_id, "CANCELLED", code=0, signal=15, detail="CANCELLED by 0")
    slurm.cycles(2)
    row = slurm.job(job.id)
    assert (row.status, row.failure_class) == ("failed", "killed_by_signal")
    assert row.error.startswith(f"Slurm cancelled job {job.slurm_job_id} (CANCELLED by 0)")


def test_cancelled_after_the_worker_asked_is_cancelled(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.cycles()
    assert slurm.client.post(f"/train/{job.id}/cancel").status_code == 202
    slurm.cycles()
    slurm.scheduler.set(job.slurm_job_id, "CANCELLED", code=0, signal=15, detail="CANCELLED by 0")
    slurm.cycles(2)
    assert (slurm.job(job.id).status, slurm.job(job.id).failure_class) == ("cancelled", None)


@pytest.mark.parametrize(("state", "code", "signal", "failure"), [
    ("OUT_OF_MEMORY", 0, 125, "out_of_memory"),
    ("TIMEOUT", 0, 0, "time_limit"),
    ("NODE_FAIL", 0, 0, "node_fail"),
])
def test_slurms_own_endings_get_their_own_classes(slurm: SlurmWorker, state, code, signal, failure):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, TRAINING_LOG)
    slurm.cycles()
    slurm.rc(job, -15 if state == "TIMEOUT" else -9)  # what the trainer died of, as the script saw it
    slurm.scheduler.set(job.slurm_job_id, state, code=code, signal=signal)
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.failure_class) == ("failed", failure)
    assert f"({state})" in row.error and row.step == 121


def test_a_job_slurm_no_longer_knows_without_an_rc_file_is_slurm_lost(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.cycles()
    del slurm.scheduler.jobs[job.slurm_job_id]  # gone from squeue, never in sacct
    slurm.cycles(UNKNOWN_CYCLES - 1)
    assert slurm.job(job.id).status == "running"  # one missing answer is not yet a loss
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.failure_class) == ("failed", "slurm_lost")


def test_a_job_slurm_forgot_that_recorded_its_status_ends_by_that_status(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.cycles()
    del slurm.scheduler.jobs[job.slurm_job_id]
    slurm.rc(job, 3)
    slurm.cycles(UNKNOWN_CYCLES)
    assert (slurm.job(job.id).failure_class, slurm.job(job.id).exit_code) == ("trainer_crashed", 3)


def test_while_slurm_does_not_answer_nothing_changes(slurm: SlurmWorker):
    """slurmctld restarted mid-job: the job carried on (the reference saw it end COMPLETED)."""
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, TRAINING_LOG)
    slurm.cycles()
    before = slurm.job(job.id)
    slurm.scheduler.down = True
    slurm.cycles(UNKNOWN_CYCLES + 2)
    after = slurm.job(job.id)
    assert (after.status, after.version) == ("running", before.version)


def test_a_job_that_ran_between_two_cycles_still_passes_through_running(slurm: SlurmWorker):
    job = slurm.submit()
    slurm.rc(job, 3)
    slurm.scheduler.set(job.slurm_job_id, "FAILED", code=3, signal=0)
    slurm.cycles()
    assert slurm.job(job.id).status == "failed"
    events = [(e.from_status, e.to_status) for e in repo.job_events(slurm.db, job.id)]
    assert ("queued", "running") in events and ("running", "failed") in events


def test_a_final_write_the_ledger_refuses_is_retried_next_cycle_with_the_same_outcome(slurm: SlurmWorker,
                                                                                      monkeypatch):
    from lora_worker.errors import LedgerBusy
    from lora_worker.slurm import poller as poller_module

    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, TRAINING_LOG)
    slurm.cycles()
    slurm.rc(job, 3)
    slurm.scheduler.set(job.slurm_job_id, "FAILED", code=3, signal=0)
    real = poller_module.repo.fail_job
    refusals = []

    def busy_once(*args, **kwargs):
        if not refusals:
            refusals.append(1)
            raise LedgerBusy("database is locked")
        return real(*args, **kwargs)

    monkeypatch.setattr(poller_module.repo, "fail_job", busy_once)
    slurm.cycles()
    assert slurm.job(job.id).status == "running" and refusals
    slurm.rc(job, 0)  # whatever changes meanwhile, the outcome was decided
    slurm.cycles()
    row = slurm.job(job.id)
    assert (row.status, row.failure_class, row.exit_code) == ("failed", "trainer_crashed", 3)
    assert (slurm.settings.log_dir / f"job-{job.id}.log").read_text().count("the job is failed") == 1


def test_a_running_job_requeued_despite_no_requeue_is_stopped_and_failed_node_fail(slurm: SlurmWorker):
    """The reference's lost node: the job went PENDING again (Restarts=1) while the old trainer still ran."""
    job = slurm.submit()
    sid = job.slurm_job_id
    slurm.scheduler.set(sid, "RUNNING")
    slurm.log(job, TRAINING_LOG)
    slurm.cycles()
    slurm.scheduler.set(sid, "PENDING", "BeginTime")
    slurm.cycles()
    assert slurm.scheduler.cancels() == [("scancel", sid)]
    assert slurm.job(job.id).status == "running"  # until Slurm says it ended
    slurm.scheduler.set(sid, "CANCELLED", code=0, signal=0, detail="CANCELLED by 0")
    slurm.cycles(2)
    row = slurm.job(job.id)
    assert (row.status, row.failure_class) == ("failed", "node_fail")
    assert "requeued" in row.error


def test_a_link_or_fifo_planted_at_the_log_or_the_status_file_is_never_followed_nor_waited_on(slurm: SlurmWorker):
    """slurm_log_dir is on storage the nodes write: what stands at a job's names there is not trusted."""
    job = slurm.submit()
    sid = job.slurm_job_id
    secret = slurm.settings.state_dir / "elsewhere.log"
    secret.write_text("loading model for process 0/1\n" + steps_bar(399, loss=0.01))
    log_path(slurm.settings, job.id).unlink()  # the log dispatch made, swapped for a link
    log_path(slurm.settings, job.id).symlink_to(secret)
    os.mkfifo(rc_path(slurm.settings, job.id))  # an open without O_NONBLOCK would wait here for a writer
    slurm.scheduler.set(sid, "RUNNING")
    slurm.cycles()
    row = slurm.job(job.id)
    assert row.status == "running" and row.step in (None, 0)  # the link's target was not read
    slurm.scheduler.set(sid, "COMPLETED", code=0, signal=0)
    slurm.cycles(2)
    row = slurm.job(job.id)
    assert row.status == "failed" and row.step in (None, 0)  # no status recorded, no LoRA: never a success


def test_every_phase_in_one_cycles_read_is_recorded_once_by_the_poller(slurm: SlurmWorker):
    """A cycle reads all the log the node wrote since the last one: four phase markers in one read, each an event."""
    job = slurm.submit()
    slurm.scheduler.set(job.slurm_job_id, "RUNNING")
    slurm.log(job, TRAINING_LOG)
    slurm.cycles(3)
    phases = [(e.reason, e.actor) for e in repo.job_events(slurm.db, job.id)
              if e.from_status == e.to_status == "running"]
    assert phases == [(f"phase {p}", "slurm") for p in ("loading_model", "caching_latents", "preparing_training",
                                                          "training")]

"""An sbatch that fails or times out after slurmctld queued the job: the job is looked up by its unique name
and adopted (the row follows it) or scancelled; never left running while the row says launch_error."""
from __future__ import annotations

from pathlib import Path

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.slurm import scheduler as scheduler_module
from lora_worker.slurm.sbatch import job_name
from tests.helpers import wait_for
from tests.slurm.fakes import SlurmWorker
from tests.slurm.fakes import cmdline as _cmdline


@pytest.mark.parametrize("trouble", ["queue-then-fail", "queue-then-timeout"])
def test_a_job_sbatch_queued_without_answering_is_adopted_by_its_name(slurm: SlurmWorker, trouble: str):
    slurm.scheduler.sbatch_trouble = trouble
    job = slurm.submit()
    (sid,) = slurm.scheduler.jobs
    assert job.slurm_job_id == sid and job.status == "queued"  # the row follows the job Slurm queued
    assert ("squeue", f"--name={job_name(slurm.settings, job.id)}") in slurm.scheduler.calls
    assert slurm.scheduler.cancels() == []


def test_when_the_lookup_cannot_answer_the_name_is_scancelled_and_the_row_fails(slurm: SlurmWorker):
    slurm.scheduler.sbatch_trouble = "queue-then-fail"
    real_find = slurm.scheduler.find_by_name

    def blind(name: str) -> list[str]:
        real_find(name)
        raise scheduler_module.SchedulerUnavailable("squeue: Unable to contact slurm controller")
    slurm.scheduler.find_by_name = blind  # type: ignore[method-assign]
    answer = slurm.client.post("/train", json=slurm.host.payload())
    assert answer.status_code == 503 and answer.get_json()["error"] == "launch_failed"
    row = repo.get_job(slurm.db, answer.get_json()["details"]["job_id"])
    assert (row.status, row.failure_class) == ("failed", "launch_error")
    assert slurm.scheduler.running() == []  # scancel --name reached the job nobody could see
    assert f"scancel --name={job_name(slurm.settings, row.id)}" in row.error


def test_several_jobs_of_the_name_are_all_scancelled(slurm: SlurmWorker):
    slurm.scheduler.sbatch_trouble = "queue-then-fail"
    real_submit = slurm.scheduler.submit

    def twice(options, script, args=()):  # a retried RPC that slurmctld took both times
        try:
            real_submit(options, script, args)
        except scheduler_module.SchedulerUnavailable:
            pass
        return real_submit(options, script, args)
    slurm.scheduler.submit = twice  # type: ignore[method-assign]
    answer = slurm.client.post("/train", json=slurm.host.payload())
    assert answer.status_code == 503
    assert len(slurm.scheduler.jobs) == 2 and slurm.scheduler.running() == []


# -- the same on the fake Slurm's command-line tools, with the real poller process ---------------------------

def _trouble(settings, what: str) -> None:
    (Path(settings.slurm_bin_dir) / "trouble").write_text(what)


@pytest.mark.slow
@pytest.mark.parametrize("trouble", ["fail", "hang"])
def test_on_the_tools_an_sbatch_that_queued_then_failed_or_hung_leaves_the_job_followed(
        worker, host, trouble: str, monkeypatch: pytest.MonkeyPatch):
    client, db, settings = worker
    _trouble(settings, trouble)
    monkeypatch.setattr(scheduler_module, "COMMAND_TIMEOUT_S", 3.0)
    answer = client.post("/train", json=host.payload())
    assert answer.status_code == 202, answer.get_json()
    job_id = answer.get_json()["worker_job_id"]
    row = wait_for(lambda: (j := repo.get_job(db, job_id)).status in ("succeeded", "failed", "cancelled") and j,
                   timeout=60, what="the job to end")
    assert (row.status, row.slurm_job_id) == ("succeeded", "100"), row.error


@pytest.mark.slow
def test_on_the_tools_a_job_nobody_can_see_after_a_failed_sbatch_is_scancelled(worker, host):
    from tests.helpers import set_modes

    client, db, settings = worker
    set_modes(settings.sd_scripts_dir, hold_at_step=3, release_file=str(host.root / "never"))
    _trouble(settings, "fail-blind")
    answer = client.post("/train", json=host.payload())
    assert answer.status_code == 503, answer.get_json()
    row = repo.get_job(db, answer.get_json()["details"]["job_id"])
    assert (row.status, row.failure_class) == ("failed", "launch_error")
    token = f"--output_dir={row.output_dir}".encode()
    wait_for(lambda: not [p for p in Path("/proc").iterdir() if p.name.isdigit() and token in _cmdline(p)],
             timeout=20, what="no process of the job left")

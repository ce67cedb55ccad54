"""More than one active job on Slurm, up to max_active_jobs, by the one-active-job index over slots
slurm-0 … slurm-N-1; the local backend keeps its one slot."""
from __future__ import annotations

from lora_worker.ledger import repository as repo
from lora_worker.ledger.models import Job
from tests.helpers import payload
from tests.slurm.fakes import SlurmWorker


def test_jobs_take_the_free_slots_up_to_max_active_jobs_then_409(slurm: SlurmWorker):
    jobs = [slurm.submit(n) for n in range(3)]
    assert [j.slot for j in jobs] == ["slurm-0", "slurm-1", "slurm-2"]
    assert [j.backend for j in jobs] == ["slurm"] * 3
    assert len({j.slurm_job_id for j in jobs}) == 3
    answer = slurm.client.post("/train", json=payload(slurm.host.dataset, slurm.host.model,
                                                      output_dir=str(slurm.host.dataset.parent / "output9")))
    assert answer.status_code == 409 and answer.get_json()["error"] == "job_active"
    assert len(repo.list_jobs(slurm.db)) == 3  # the refusal wrote nothing
    assert len(slurm.scheduler.scripts) == 3  # and submitted nothing


def test_a_freed_slot_is_taken_again(slurm: SlurmWorker):
    jobs = [slurm.submit(n) for n in range(3)]
    slurm.rc(jobs[1], 3)
    slurm.scheduler.set(jobs[1].slurm_job_id, "FAILED", code=3, signal=0)
    for j in (jobs[0], jobs[2]):
        slurm.scheduler.set(j.slurm_job_id, "PENDING", "Resources")
    slurm.cycles()
    assert slurm.job(jobs[1].id).status == "failed"
    assert slurm.submit(5).slot == "slurm-1"


def test_the_index_not_a_count_refuses_a_taken_slot(slurm: SlurmWorker):
    """A row put into slurm-0 behind dispatch's back (a racing request) makes the next one take slurm-1."""
    first = slurm.submit()
    with slurm.db.write() as s:
        s.get(Job, first.id).slot = "slurm-1"
    second = slurm.submit(1)
    assert second.slot == "slurm-0"
    assert slurm.submit(2).slot == "slurm-2"


def test_a_slurm_job_is_not_refused_for_a_busy_gpu_slurm_allocates_it(slurm: SlurmWorker):
    # device 0 carries the TTS process in the fake NVML of the local tests; Slurm decides where jobs run
    assert slurm.submit(0, device_index=0).status == "queued"


def test_the_local_backend_keeps_one_slot(api, host, launches):
    first = api.post("/train", json=payload(host.dataset, host.model))
    assert first.status_code == 202
    second = api.post("/train", json=payload(host.dataset, host.model, output_dir=str(host.dataset.parent / "o2")))
    assert second.status_code == 409
    body = api.get(f"/train/{first.get_json()['worker_job_id']}").get_json()
    assert (body["backend"], body["slurm_job_id"], body["queue_reason"]) == ("local", None, None)


def test_metrics_show_the_queue_depth_of_jobs_waiting_for_a_gpu(slurm: SlurmWorker):
    from prometheus_client.parser import text_string_to_metric_families

    def depth() -> float:
        text = slurm.client.get("/metrics").get_data(as_text=True)
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "lora_worker_queue_depth"]
        return family.samples[0].value

    jobs = [slurm.submit(n) for n in range(3)]
    assert depth() == 3
    slurm.scheduler.set(jobs[0].slurm_job_id, "RUNNING")
    for j in jobs[1:]:
        slurm.scheduler.set(j.slurm_job_id, "PENDING", "Resources")
    slurm.cycles()
    assert depth() == 2


def test_a_submission_sbatch_refuses_fails_the_row_and_frees_its_slot(slurm: SlurmWorker):
    slurm.scheduler.down = True
    answer = slurm.client.post("/train", json=payload(slurm.host.dataset, slurm.host.model))
    assert answer.status_code == 503 and answer.get_json()["error"] == "launch_failed"
    (row,) = repo.list_jobs(slurm.db)
    assert (row.status, row.failure_class, row.slurm_job_id) == ("failed", "launch_error", None)
    assert "Slurm refused job" in row.error
    slurm.scheduler.down = False
    assert slurm.submit(1).slot == "slurm-0"


def test_a_job_nothing_could_follow_is_scancelled_before_the_row_fails(slurm: SlurmWorker):
    from lora_worker.errors import LaunchFailed

    def no_poller(settings):
        raise LaunchFailed("The Slurm poller exited with status 1 before taking its lock.")

    slurm.client.application.extensions["lora_worker"].backend.start_poller = no_poller
    answer = slurm.client.post("/train", json=payload(slurm.host.dataset, slurm.host.model))
    assert answer.status_code == 503
    (sid,) = slurm.scheduler.scripts
    assert slurm.scheduler.cancels() == [("scancel", sid)]
    assert repo.list_jobs(slurm.db)[0].status == "failed"

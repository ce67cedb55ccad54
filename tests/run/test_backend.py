"""The backend seam: the web and dispatch start runs, and reconcile asks after them, only through a Backend.
A backend that is not the local supervisor (a cluster's, here a recording stand-in) plugs into create_app as
it is: the web, dispatch and the ledger are unchanged."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lora_worker import create_app
from lora_worker.checks import Check
from lora_worker.config import Settings, TrainerProfile
from lora_worker.host.locks import hold_lock, job_lock_path
from lora_worker.ledger import repository as repo
from lora_worker.backends import Backend, backend_for
from lora_worker.run.local import LaunchOnly, LocalBackend
from lora_worker.states import JobState


@dataclass
class ClusterStandIn:
    """What a scheduler-backed backend gives: it accepts jobs, and says which of them it still attends."""

    name: str = "cluster"
    label: str = "the cluster"
    places_here: bool = True  # admitted by this host's NVML all the same: the test host's fake cards
    cancels_queued_at_once: bool = True
    submitted: list[int] = field(default_factory=list)
    attending: set[int] = field(default_factory=set)
    abandoned: list[int] = field(default_factory=list)

    def launch(self, job_id: int, settings: Settings) -> None:
        self.submitted.append(job_id)
        self.attending.add(job_id)

    def attended(self, job_id: int, settings: Settings) -> bool:
        return job_id in self.attending

    def wake(self, job) -> None:
        pass

    def abandon(self, job, settings: Settings) -> tuple[int, ...]:
        self.abandoned.append(job.id)
        return ()

    def slots(self, settings: Settings) -> list[str]:
        return ["train"]

    def profile(self, settings: Settings, tier: str, device_index: int) -> TrainerProfile:
        return TrainerProfile(settings.devices[device_index].train_batch_size, "bf16")  # the cards it is given

    def visible_devices(self, device_index: int) -> str | None:
        return str(device_index)

    def files_dir(self, settings: Settings) -> Path:
        return settings.state_dir

    def readiness(self, settings: Settings, *, trainer: bool) -> list[Check]:
        return []


def test_the_local_backend_attends_a_job_exactly_while_its_job_lock_is_held(migrated):
    local: Backend = LocalBackend()
    assert not local.attended(7, migrated)
    fd = hold_lock(job_lock_path(migrated, 7))
    assert fd is not None
    try:
        assert local.attended(7, migrated) and not local.attended(8, migrated)
    finally:
        os.close(fd)
    assert not local.attended(7, migrated)


def test_the_settings_pick_the_local_backend_and_a_launch_callable_only_replaces_its_start(migrated):
    assert isinstance(backend_for(migrated), LocalBackend)
    started: list[int] = []
    recorder = backend_for(migrated, lambda job_id, settings: started.append(job_id))
    assert isinstance(recorder, LaunchOnly) and recorder.name == "local"
    recorder.launch(3, migrated)
    assert started == [3] and not recorder.attended(3, migrated)  # attended still means the job lock


def test_another_backend_plugs_into_the_app_for_dispatch_and_reconcile(migrated, host, db):
    cluster = ClusterStandIn()
    app = create_app(migrated, backend=cluster)
    client = app.test_client()
    try:
        response = client.post("/train", json=host.payload())
        assert response.status_code == 202, response.get_json()
        job_id = response.get_json()["worker_job_id"]
        assert cluster.submitted == [job_id]
        # its supervisor, wherever it runs, takes the job; no lock on this host says so, the backend does
        repo.transition(db, job_id, JobState.RUNNING, actor="supervisor")
        assert client.get(f"/train/{job_id}").get_json()["status"] == "running"
        cluster.attending.clear()  # the allocation ended without a final state
        done = client.get(f"/train/{job_id}").get_json()
        assert (done["status"], done["failure_class"]) == ("failed", "supervisor_lost")
        assert cluster.abandoned == [job_id]  # asked to stop what is left before the row failed
    finally:
        app.extensions["lora_worker"].db.dispose()

"""Where a job's run happens, behind one interface: the web, dispatch, reconcile and the operator's CLI
decide nothing by a backend's name; they ask the job's `Backend`.

`LocalBackend` (run/local.py, `backend = "local"`): a detached supervisor on this host, attending the job while
it holds the job's flock. `SlurmBackend` (slurm/backend.py): an sbatch of the job, followed by the poller.

The seam:
  - `launch`: start attending a queued row (or raise LaunchFailed);
  - `attended`: whether something attends the job now (reconcile fails an active job nobody attends);
  - `wake`: a cancel was just flagged on the row: tell whoever attends it, now rather than at its next look;
  - `abandon`: reconcile is about to fail the row: make sure nothing of the job still runs (the pids killed,
    once they are gone); None if that cannot be made sure now, and the row is left for a later reconcile; it
    raises OutlivedKill (host/processes.py) when what it killed is still there, and the row stays active;
  - `places_here`: whether the job runs on this host's GPUs (so dispatch admits it by NVML, the GPU lock and
    the sandbox here, `device_index` picks the card, and the ETA history is that card's) or the scheduler's
    (`device_index` is accepted and has no effect);
  - `profile`: the batch size and precision the trainer is told for a job (the local card's profile, or the
    tier's Slurm resources); a resume's fingerprint rebuilds the argv with the row's backend's, never another's;
  - `visible_devices`: the CUDA_VISIBLE_DEVICES a job's recorded environment names, or None where the
    scheduler sets it on the node;
  - `files_dir`: where the worker puts a file of a job that the trainer's host reads (its dataset config):
    the state dir here, the Slurm log dir (storage the nodes share) under Slurm;
  - `readiness`: the deep health checks of where the backend places jobs, beyond this host's own (local: none;
    Slurm: the controller, the partition's nodes for each tier, the opt-in probe job);
  - `slots`: the one-active-job index's slots a new row may take, tried in order;
  - `cancels_queued_at_once`: whether a cancel of a queued row ends it at once (nothing has started it) or only
    flags it (it may start on a node any moment).
The backend is chosen per row (`backend_of(job)`: the row's `backend` column), never from the settings alone:
a worker switched back to local keeps attending the Slurm rows it has. `backend_for(settings)` is the one
for new jobs.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lora_worker import slurm
from lora_worker.checks import Check
from lora_worker.config import Settings, TrainerProfile
from lora_worker.run.local import Launch, LaunchOnly, LocalBackend

if TYPE_CHECKING:
    from lora_worker.ledger.models import Job


class Backend(Protocol):
    name: str
    label: str  # for a sentence: "this host", "Slurm"
    places_here: bool
    cancels_queued_at_once: bool

    def launch(self, job_id: int, settings: Settings) -> None:
        """Start attending the queued job `job_id`; return once it is attended (it will leave `queued` by
        itself), or raise LaunchFailed. Called once, after the job's row is written."""

    def attended(self, job_id: int, settings: Settings) -> bool:
        """Whether something attends the job now. An active job nobody attends is failed by reconcile, so a
        backend must say True for as long as its run may still write the row."""

    def wake(self, job: Job) -> None:
        """A cancel was just flagged on `job`'s row. Best effort: whoever attends it looks at the row anyway."""

    def abandon(self, job: Job, settings: Settings) -> tuple[int, ...] | None:
        """Stop whatever of the unattended `job` still runs; the pids killed, or None if not sure now."""

    def slots(self, settings: Settings) -> list[str]:
        """The slots a new row may take, tried in order."""

    def profile(self, settings: Settings, tier: str, device_index: int) -> TrainerProfile:
        """The batch size and precision of a job of `tier` asked for `device_index` (KeyError: a card the
        settings do not name, where the card decides)."""

    def visible_devices(self, device_index: int) -> str | None:
        """CUDA_VISIBLE_DEVICES for a job's recorded environment, or None: the scheduler sets it on the node."""

    def files_dir(self, settings: Settings) -> Path:
        """A directory of the worker's that the host running the trainer reads too."""

    def readiness(self, settings: Settings, *, trainer: bool) -> list[Check]:
        """The deep checks of where the backend places jobs, beyond this host's own; `trainer`: also those that
        start the trainer (seconds, or a node's time)."""


def backend_for(settings: Settings, launch: Launch | None = None) -> Backend:
    """The backend new jobs get (`backend = "local"` or Slurm's), or a local one that starts runs with
    `launch` (a test's recorder)."""
    if launch is not None:
        return LaunchOnly(launch)
    return named(settings.backend)


def named(name: str) -> Backend:
    """The backend of a row's `backend` column (or of the `backend` setting): the one name comparison outside
    slurm/ and the settings' checks."""
    if name == slurm.NAME:
        from lora_worker.slurm.backend import SlurmBackend  # only a worker with Slurm rows loads it

        return SlurmBackend()
    return LocalBackend()


def backend_of(job: Job, default: Backend | None = None) -> Backend:
    """The backend of this row: `default` (the worker's own, a test's) if it is the row's, else the row's."""
    if default is not None and default.name == job.backend:
        return default
    return named(job.backend)

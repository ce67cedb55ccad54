"""Where a job's run happens, behind one small interface: the web and dispatch start runs and reconcile asks
after them only through a `Backend`, never through the supervisor's process or lock files themselves.

`LocalBackend` (run/local.py, `backend = "local"`): a detached supervisor on this host, attending the job while
it holds the job's flock. `SlurmBackend` (slurm/, `backend = "slurm"`):
  - `launch` submits the job (`sbatch` of a batch script running the stored argv on a node that sees the same
    train root and model paths) and returns once the scheduler accepted it and the poller runs, or raises
    LaunchFailed;
  - `attended` is the poller's lock (or, without a poller, whether Slurm still knows the job), so reconcile
    never fails a job that is merely queued on the cluster;
  - a cancel needs nothing of the backend: the API flags the row and the poller scancels.
`backend_for(settings)` is the one place that picks a backend, so adding one changes this package only.
"""
from __future__ import annotations

from typing import Protocol

from lora_worker.config import Settings
from lora_worker.run.local import Launch, LaunchOnly, LocalBackend


class Backend(Protocol):
    name: str

    def launch(self, job_id: int, settings: Settings) -> None:
        """Start attending the queued job `job_id`; return once it is attended (it will leave `queued` by
        itself), or raise LaunchFailed. Called once, after the job's row is written."""

    def attended(self, job_id: int, settings: Settings) -> bool:
        """Whether something attends the job now. An active job nobody attends is failed by reconcile, so a
        backend must say True for as long as its run may still write the row."""


def backend_for(settings: Settings, launch: Launch | None = None) -> Backend:
    """The backend the settings ask for (`backend = "local"` or `"slurm"`), or a local one that starts runs
    with `launch` (a test's recorder)."""
    if launch is not None:
        return LaunchOnly(launch)
    if settings.backend == "slurm":
        from lora_worker.slurm.backend import SlurmBackend  # only a Slurm worker loads it

        return SlurmBackend()
    return LocalBackend()

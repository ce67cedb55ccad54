"""Where a job's run happens, behind one small interface: the web and dispatch start runs and reconcile asks
after them only through a `Backend`, never through the supervisor's process or lock files themselves.

Today's backend is `LocalBackend` (run/local.py): a detached supervisor on this host, attending the job while
it holds the job's flock. A cluster backend (Slurm) fits without touching web/ or ledger/:
  - `launch` submits the job (`sbatch` of `python -m lora_worker.run <job_id>` on a node that sees the same
    ledger, settings and train root) and returns once the scheduler accepted it, or raises LaunchFailed;
  - `attended` answers from the scheduler (the allocation is pending or running) rather than from a lock on
    this host, so reconcile never fails a job that is merely queued on the cluster;
  - a cancel needs nothing of the backend: the supervisor, wherever it runs, polls the ledger for it.
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
    """The backend the settings ask for (today always the local one), or one that starts runs with `launch`."""
    return LocalBackend() if launch is None else LaunchOnly(launch)

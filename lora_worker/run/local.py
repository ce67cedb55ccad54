"""The local backend (see backends.py): a job's supervisor started from the web process, detached, and
reaped before we return; it attends the job while it holds the job's lock.

The ready pipe the web's POST waits on is host/starter.py's (`start_detached`, shared with the Slurm poller);
here is the wake-up the web's cancel sends the running supervisor (`wake_supervisor`, `listen_for_wakeups`). The
supervisor imports this module before it takes the job lock, so it imports nothing heavy at the top.
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Protocol

from lora_worker.checks import Check
from lora_worker.config import Settings, TrainerProfile, settings_to_json
from lora_worker.host.locks import is_locked, job_lock_path
from lora_worker.host.detach import JOB_LOCK_ENV
from lora_worker.host.starter import SETTINGS_ENV, start_detached

__all__ = ["SETTINGS_ENV", "start_detached", "LocalBackend", "LaunchOnly", "launch_supervisor"]

if TYPE_CHECKING:
    from lora_worker.run.leftovers import JobProcesses

Launch = Callable[[int, Settings], None]

# The cancel's wake-up. Its default action is to be ignored, so a wake-up that reaches a process not (or not
# yet) listening for it does nothing at all; SIGUSR1 would kill it.
WAKE_SIGNAL = signal.SIGURG


class SupervisedJob(Protocol):
    @property
    def boot_id(self) -> str | None: ...
    @property
    def supervisor_pid(self) -> int | None: ...
    @property
    def supervisor_start_ticks(self) -> int | None: ...


def launch_supervisor(job_id: int, settings: Settings) -> None:
    """Start `python -m lora_worker.run <job_id>` and return once it holds the job's lock."""
    env = dict(os.environ)
    env[SETTINGS_ENV] = settings_to_json(settings)
    env["PYTHONPATH"] = supervisor_path()
    env[JOB_LOCK_ENV] = str(job_lock_path(settings, job_id))  # taken before anything else is imported there
    # -S: no `site` (its .pth files and the editable install's finder were a third of the supervisor's start,
    # which the POST waits for); the supervisor imports nothing outside the standard library and this package.
    start_detached([sys.executable, "-S", "-m", "lora_worker.run", str(job_id)], env,
                   what=f"The supervisor for job {job_id}", job_id=job_id)


def supervisor_path() -> str:
    """The import path a supervisor started with -S needs: this package's own parent first (an editable
    install puts it on no path entry), then the web's own path, so what it finds is what the web found."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(dict.fromkeys([here, *(p for p in sys.path if p)]))


def wake_supervisor(boot_id: str | None, pid: int | None, start_ticks: int | None) -> bool:
    """Tell a job's running supervisor to look at its row now (a cancel was just flagged), instead of at its
    next ledger poll. Only the very process the row recorded is signalled: boot id, pid and start time must
    all match, and it is pinned by a pidfd between the check and the signal. Best effort: whatever goes
    wrong, the supervisor's poll still finds the cancel. True if the signal was sent."""
    if boot_id is None or pid is None or start_ticks is None:
        return False
    from lora_worker.host.processes import Identity, signal_identity  # not before the supervisor's lock

    try:
        return signal_identity(Identity(boot_id, pid, start_ticks), WAKE_SIGNAL)
    except OSError:  # EPERM (another user's process under a reused pid), a kernel without pidfds
        return False


def listen_for_wakeups() -> int:
    """Make WAKE_SIGNAL, SIGCHLD (and any other signal with a Python handler, SIGTERM included) readable on the fd
    returned: the run loop waits on it next to the trainer's pipe. A flag set by a handler would not do:
    select and sleep resume after a handler (PEP 475), so the loop would still wait out its period."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)  # the C-level handler writes a byte per signal; a full pipe drops it
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(WAKE_SIGNAL, _woken)
    # A child's exit wakes the loop too: the launcher's end is seen at once, not when the pause runs out
    # (up to 0.25 s between the trainer's exit and the final state otherwise).
    signal.signal(signal.SIGCHLD, _woken)
    return wake_r


def _woken(_signum: int, _frame: FrameType | None) -> None:
    """Nothing to do here: the byte the interpreter wrote on the wake-up fd is the message."""


class LocalBackend:
    """The detached supervisor on this host, attending the job while it holds the job lock (backends.py)."""

    name = "local"
    label = "this host"
    places_here = True  # this host's GPU, admitted by NVML and the GPU lock, in this host's sandbox
    cancels_queued_at_once = True  # a queued row has no supervisor yet, or one that has not started the trainer

    def launch(self, job_id: int, settings: Settings) -> None:
        launch_supervisor(job_id, settings)

    def attended(self, job_id: int, settings: Settings) -> bool:
        # The kernel drops the flock when the supervisor dies, zombie or not: no pid is trusted.
        return is_locked(job_lock_path(settings, job_id))

    def wake(self, job: SupervisedJob) -> None:
        wake_supervisor(job.boot_id, job.supervisor_pid, job.supervisor_start_ticks)

    def abandon(self, job: JobProcesses, settings: Settings) -> tuple[int, ...]:
        """The pids killed, once they are gone; OutlivedKill while one of them is not."""
        from lora_worker.host.processes import OutlivedKill  # not before the supervisor's lock
        from lora_worker.run.leftovers import GONE_WAIT_S, kill_leftovers

        left = kill_leftovers(job, GONE_WAIT_S)
        if left.surviving:
            raise OutlivedKill(left.surviving, GONE_WAIT_S)
        return left.killed

    def slots(self, settings: Settings) -> list[str]:
        return ["train"]  # one training at a time on this host

    def profile(self, settings: Settings, tier: str, device_index: int) -> TrainerProfile:
        """The card's: its batch size (config.devices), and bf16, which both of this host's cards take."""
        return TrainerProfile(settings.devices[device_index].train_batch_size, "bf16")

    def visible_devices(self, device_index: int) -> str | None:
        return str(device_index)  # the card the request named, admitted by NVML and its lock

    def files_dir(self, settings: Settings) -> Path:
        return settings.state_dir  # the supervisor on this host reads it, and binds what the trainer needs

    def readiness(self, settings: Settings, *, trainer: bool) -> list[Check]:
        return []  # this host's own checks (dispatch/readiness.py) are all there is


@dataclass
class LaunchOnly(LocalBackend):
    """The local backend with another way to start runs: a test's recorder, a benchmark's counter."""

    start: Launch

    def launch(self, job_id: int, settings: Settings) -> None:
        self.start(job_id, settings)

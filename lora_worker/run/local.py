"""The local backend (see run/backend.py): a job's supervisor started from the web process, detached, and
reaped before we return; it attends the job while it holds the job's lock."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from lora_worker.config import Settings, settings_to_json
from lora_worker.errors import LaunchFailed
from lora_worker.host.locks import is_locked, job_lock_path

Launch = Callable[[int, Settings], None]

SETTINGS_ENV = "LORA_WORKER_SETTINGS"
LAUNCH_TIMEOUT_S = 20.0


def launch_supervisor(job_id: int, settings: Settings) -> None:
    """Start `python -m lora_worker.run <job_id>` and return once it holds the job's lock.

    New session (our signals and terminal never reach it), stdin from /dev/null, no inherited descriptors
    but stderr (journald). The process we wait for is only the first of a double fork, so nothing is left
    for the web worker to reap later: no zombie, whatever gunicorn does with SIGCHLD.
    """
    env = dict(os.environ)
    env[SETTINGS_ENV] = settings_to_json(settings)
    try:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            [sys.executable, "-m", "lora_worker.run", str(job_id)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True, env=env,
        )
    except OSError as exc:
        raise LaunchFailed(f"Cannot start the supervisor for job {job_id}: {exc}", job_id=job_id) from exc
    try:
        rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait()
        raise LaunchFailed(f"The supervisor for job {job_id} did not start in {LAUNCH_TIMEOUT_S:g}s.",
                           job_id=job_id) from exc
    if rc != 0:
        raise LaunchFailed(f"The supervisor for job {job_id} exited with status {rc} before taking the job.",
                           job_id=job_id)


class LocalBackend:
    """The detached supervisor on this host, attending the job while it holds the job lock."""

    name = "local"

    def launch(self, job_id: int, settings: Settings) -> None:
        launch_supervisor(job_id, settings)

    def attended(self, job_id: int, settings: Settings) -> bool:
        # The kernel drops the flock when the supervisor dies, zombie or not: no pid is trusted.
        return is_locked(job_lock_path(settings, job_id))


@dataclass
class LaunchOnly(LocalBackend):
    """The local backend with another way to start runs: a test's recorder, a benchmark's counter."""

    start: Launch

    def launch(self, job_id: int, settings: Settings) -> None:
        self.start(job_id, settings)

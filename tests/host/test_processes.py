"""The OS seam's reaping: orphans are reaped, the trainer's own status is left to Popen, and an idle loop
never lists /proc."""
from __future__ import annotations

import subprocess
import sys

import pytest

from lora_worker.host import processes
from tests.helpers import wait_for


def exited(pid: int) -> bool:
    return processes.state_of(pid) == "Z"


def test_reap_orphans_reaps_exited_children_but_leaves_the_kept_one_to_popen():
    kept = subprocess.Popen([sys.executable, "-c", "pass"])
    orphan = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: exited(kept.pid) and exited(orphan.pid), what="both children exit")
    processes.reap_orphans(keep={kept.pid})
    assert processes.state_of(orphan.pid) is None  # reaped
    orphan.wait()  # Popen learns it is gone (ECHILD), so it does not warn later
    assert exited(kept.pid) and kept.wait() == 0  # still waiting for Popen, with its status intact


def test_reap_orphans_does_not_list_processes_while_no_child_has_exited(monkeypatch: pytest.MonkeyPatch):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def listing(*_args: object) -> None:
            raise AssertionError("listed /proc with no exited child")

        monkeypatch.setattr(processes.psutil, "Process", listing)
        processes.reap_orphans(keep=set())
    finally:
        sleeper.kill()
        sleeper.wait()

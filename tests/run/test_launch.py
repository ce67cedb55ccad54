"""The launch handshake (run/local.py `start_detached`): the web's POST waits on the ready pipe itself, so it
ends when the supervisor's byte lands, or at once when the supervisor died without writing it, and the
process it started is reaped before it returns.

A stand-in supervisor plays the real one's part: it double-forks like run/__main__.py (the first process
exits at once), waits, records the CLOCK_MONOTONIC instant just before it writes the byte (the clock is the
same for every process), then stays alive as a supervisor would.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import psutil
import pytest

from lora_worker.errors import LaunchFailed
from lora_worker.run.local import start_detached
from tests.helpers import pid_alive, wait_for

pytestmark = pytest.mark.slow  # every test here starts a real process

STAND_IN = r"""
import json, os, sys, time
mode, record, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
fd = int(sys.argv[-1].split("=", 1)[1])
if mode == "exit-3":
    sys.exit(3)  # the first process fails before it forks (a bad interpreter, an import error)
if mode == "hang-unforked":
    time.sleep(60)  # never forks, never writes
if os.fork():
    os.close(fd)
    sys.exit(0)
os.setsid()
with open(record, "w") as f:
    json.dump({"pid": os.getpid()}, f)
time.sleep(delay)
if mode == "ready":
    at = time.monotonic()
    with open(record, "w") as f:
        json.dump({"pid": os.getpid(), "ready_at": at}, f)
    os.write(fd, b"1")
    os.close(fd)
    time.sleep(60)
elif mode == "die":
    os._exit(1)  # the lock was taken by another supervisor, the settings did not parse...
elif mode == "hang":
    time.sleep(60)
"""


@pytest.fixture
def stand_ins():
    """Kills every stand-in supervisor a test started (they outlive the launch, as real ones do)."""
    records: list[Path] = []
    yield records
    for path in records:
        if path.exists():
            pid = json.loads(path.read_text())["pid"]
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def launch(tmp_path: Path, stand_ins: list[Path], mode: str, delay: float = 0.03, timeout_s: float = 20.0,
           n: int = 0) -> Path:
    record = tmp_path / f"stand-in-{n}.json"
    stand_ins.append(record)
    start_detached([sys.executable, "-c", STAND_IN, mode, str(record), str(delay)], dict(os.environ),
                   what="The stand-in", timeout_s=timeout_s)
    return record


def no_zombie_children() -> bool:
    return not [c for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE]


def test_the_launch_returns_within_milliseconds_of_the_ready_byte(tmp_path, stand_ins):
    lags = []
    for n in range(5):
        record = launch(tmp_path, stand_ins, "ready", delay=0.03, n=n)
        returned = time.monotonic()
        rec = json.loads(record.read_text())
        lags.append(returned - rec["ready_at"])
        assert pid_alive(rec["pid"])  # the supervisor lives on; only the first process was reaped
        assert no_zombie_children()
    # A polling wait (Popen.wait's doubling sleeps) lands tens of ms late; the pipe's poll(2), within one.
    assert statistics.median(lags) < 0.010, lags
    assert all(lag >= 0 for lag in lags)


def test_a_supervisor_that_dies_before_ready_fails_the_launch_at_once(tmp_path, stand_ins):
    started = time.monotonic()
    with pytest.raises(LaunchFailed, match="The stand-in ended before taking the job"):
        launch(tmp_path, stand_ins, "die", delay=0.03, timeout_s=20.0)
    assert time.monotonic() - started < 2.0  # the EOF, not the 20 s timeout
    assert no_zombie_children()


def test_a_first_process_that_fails_is_reported_with_its_status_at_once(tmp_path, stand_ins):
    started = time.monotonic()
    with pytest.raises(LaunchFailed, match="exited with status 3 before taking the job"):
        launch(tmp_path, stand_ins, "exit-3", timeout_s=20.0)
    assert time.monotonic() - started < 2.0
    assert no_zombie_children()


@pytest.mark.parametrize("mode", ["hang", "hang-unforked"])
def test_a_supervisor_that_never_says_ready_fails_the_launch_after_the_timeout(tmp_path, stand_ins, mode):
    started = time.monotonic()
    with pytest.raises(LaunchFailed, match=r"did not start in 0\.5s"):
        launch(tmp_path, stand_ins, mode, timeout_s=0.5)
    took = time.monotonic() - started
    assert 0.5 <= took < 2.0
    assert no_zombie_children()  # a first process that never forked was killed and reaped


def test_the_real_supervisor_holds_its_job_lock_when_the_launch_returns(migrated, host, db):
    from lora_worker.ledger import repository as repo
    from lora_worker.run.local import LocalBackend, launch_supervisor
    from tests.helpers.ledger import columns

    job = repo.create_job(db, columns())  # its folders do not exist here: the pre-exec check ends the run
    launch_supervisor(job.id, host.settings)
    assert LocalBackend().attended(job.id, host.settings)
    assert no_zombie_children()
    done = wait_for(lambda: (j := repo.get_job(db, job.id)).status not in ("queued", "running") and j,
                    timeout=30, what="the job's end")
    assert done.failure_class == "launch_error"


def test_without_pidfds_the_first_process_is_still_reaped_and_a_hang_still_times_out(tmp_path, stand_ins,
                                                                                     monkeypatch):
    def no_pidfds(pid: int) -> int:
        raise OSError(38, "Function not implemented")  # ENOSYS: a kernel before 5.3

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    launch(tmp_path, stand_ins, "ready", n=0)
    assert no_zombie_children()
    with pytest.raises(LaunchFailed, match=r"did not start in 0\.5s"):
        launch(tmp_path, stand_ins, "hang-unforked", timeout_s=0.5, n=1)
    assert no_zombie_children()

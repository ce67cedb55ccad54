"""A cancel in tens of milliseconds: the web's cancel wakes the supervisor (run/local.py `wake_supervisor`) and
the run loop's waits end on the wake-up fd (the loop's rule, that it then looks at the ledger on that very
pass, is in test_loop_rules.py). Only the process the row recorded (boot id, pid, start time) is ever
signalled."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from lora_worker.host import processes
from lora_worker.host.process_host import ProcessHost
from lora_worker.run.local import WAKE_SIGNAL, listen_for_wakeups, wake_supervisor
from tests.helpers import wait_for
from tests.helpers.wakeup import heard

# -- the real host's waits -----------------------------------------------------------------------------------

@pytest.fixture
def wake_fd():
    """The supervisor's wake-up set-up (run/main.py), in this test process; put back afterwards."""
    previous = signal.getsignal(WAKE_SIGNAL), signal.getsignal(signal.SIGCHLD)
    fd = listen_for_wakeups()
    yield fd
    old_w = signal.set_wakeup_fd(-1)
    signal.signal(WAKE_SIGNAL, previous[0])
    signal.signal(signal.SIGCHLD, previous[1])
    os.close(fd)
    os.close(old_w)


def signal_self_after(seconds: float, sig: int = WAKE_SIGNAL) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), sig))
    timer.start()
    return timer


def test_the_real_pause_ends_when_the_wake_up_signal_arrives(wake_fd):
    real = ProcessHost(wake_fd)
    signal_self_after(0.05)
    started = time.monotonic()
    real.pause(5.0)
    assert time.monotonic() - started < 1.0  # not the 5 s: PEP 475 alone would resume the wait
    assert real.woken() and not real.woken()  # taken off the pipe once
    started = time.monotonic()
    real.pause(0.1)  # nothing pending: the whole pause
    assert time.monotonic() - started >= 0.1


@pytest.mark.slow
def test_the_real_pause_ends_when_the_launcher_exits(wake_fd, tmp_path):
    real = ProcessHost(wake_fd)
    trainer = real.spawn([sys.executable, "-c", "import os, time; os.close(1); os.close(2); time.sleep(0.2)"],
                         cwd=tmp_path, env=dict(os.environ))
    try:
        started = time.monotonic()
        while trainer.poll() is None and time.monotonic() - started < 5.0:
            real.pause(5.0)  # a pause as long as this would end the test by its bound if SIGCHLD did not end it
        assert trainer.poll() is not None and time.monotonic() - started < 2.0
        assert real.woken()
    finally:
        trainer.close()


@pytest.mark.slow
def test_the_trainers_read_ends_on_a_wake_up_with_nothing_read(wake_fd, tmp_path):
    real = ProcessHost(wake_fd)
    trainer = real.spawn([sys.executable, "-c", "import time; time.sleep(30)"], cwd=tmp_path, env=dict(os.environ))
    try:
        signal_self_after(0.05)
        started = time.monotonic()
        assert trainer.read(5.0) == b""
        assert time.monotonic() - started < 1.0
        assert real.woken()
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        wait_for(lambda: trainer.poll() is not None, what="the sleeper reaped")
        trainer.close()


@pytest.mark.slow
def test_the_trainers_read_after_the_end_of_its_pipe_also_ends_on_a_wake_up(wake_fd, tmp_path):
    real = ProcessHost(wake_fd)
    # a launcher that closed its output and lives on: the loop keeps passing, waiting in read
    code = "import os, time; os.close(1); os.close(2); time.sleep(30)"
    trainer = real.spawn([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ))
    try:
        wait_for(lambda: trainer.read(0.05) is None, what="the end of the pipe")
        signal_self_after(0.05)
        started = time.monotonic()
        assert trainer.read(5.0) is None
        assert time.monotonic() - started < 1.0
        assert real.woken()
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        wait_for(lambda: trainer.poll() is not None, what="the sleeper reaped")
        trainer.close()


def test_without_a_wake_up_fd_the_pause_is_a_plain_sleep():
    real = ProcessHost()
    started = time.monotonic()
    real.pause(0.1)
    assert time.monotonic() - started >= 0.1 and not real.woken()


# -- who is signalled ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_recorded_supervisor_is_woken(listener):
    me = processes.identity_of(listener.pid)
    assert me is not None
    assert wake_supervisor(me.boot_id, me.pid, me.start_ticks)
    assert heard(listener)


@pytest.mark.parametrize("change", ["recycled pid", "another boot", "nothing recorded"])
@pytest.mark.slow
def test_a_process_that_is_not_the_recorded_one_is_never_signalled(listener, change):
    me = processes.identity_of(listener.pid)
    assert me is not None
    boot_id, pid, ticks = me.boot_id, me.pid, me.start_ticks
    if change == "recycled pid":
        ticks -= 1  # the recorded supervisor started earlier: this pid now names another process
    elif change == "another boot":
        boot_id = "0" * 8 + boot_id[8:]
    else:
        pid = None  # type: ignore[assignment]
    assert not wake_supervisor(boot_id, pid, ticks)
    assert not heard(listener)


@pytest.mark.slow
def test_a_dead_supervisor_is_not_signalled():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    me = processes.identity_of(proc.pid)
    proc.wait()
    assert me is not None and not wake_supervisor(me.boot_id, me.pid, me.start_ticks)

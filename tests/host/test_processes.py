"""The OS seam: orphans are reaped, the trainer's own status is left to Popen, an idle loop never lists /proc;
the trainer starts in a group of its own with one pipe; exit statuses are worded one way."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lora_worker.host import processes
from tests.helpers import wait_for


def exited(pid: int) -> bool:
    return processes.state_of(pid) == "Z"


@pytest.mark.slow
def test_reap_orphans_reaps_exited_children_but_leaves_the_kept_one_to_popen():
    kept = subprocess.Popen([sys.executable, "-c", "pass"])
    orphan = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: exited(kept.pid) and exited(orphan.pid), what="both children exit")
    processes.reap_orphans(keep={kept.pid})
    assert processes.state_of(orphan.pid) is None  # reaped
    orphan.wait()  # Popen learns it is gone (ECHILD), so it does not warn later
    assert exited(kept.pid) and kept.wait() == 0  # still waiting for Popen, with its status intact


@pytest.mark.slow
def test_reap_orphans_does_not_list_processes_while_no_child_has_exited(monkeypatch: pytest.MonkeyPatch):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def listing(*_args: object) -> None:
            raise AssertionError("listed /proc with no exited child")

        monkeypatch.setattr(processes, "_children", listing)
        processes.reap_orphans(keep=set())
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.slow
def test_the_trainer_is_spawned_in_its_own_group_with_one_pipe_read_until_end_of_file(tmp_path):
    from lora_worker.host.process_host import ProcessHost

    host = ProcessHost()
    code = "import sys, time; print('out', flush=True); time.sleep(0.3); print('err', file=sys.stderr)"
    trainer = host.spawn([sys.executable, "-c", code], cwd=tmp_path, env={})
    try:
        assert os.getpgid(trainer.pid) == trainer.pid != os.getpgid(0)  # a group of its own, to signal whole
        chunks = []
        while (data := trainer.read(0.05)) is not None:
            chunks.append(data)
        assert b"".join(chunks) == b"out\nerr\n"  # stdout and stderr, in the order written
        assert b"" in chunks  # a read that waited and found nothing yet is not the end
        assert trainer.read(0.0) is None
        wait_for(lambda: trainer.poll() is not None, what="the trainer's exit")
        assert trainer.returncode == 0 and processes.decode_wait_status(trainer.returncode) == "exit status 0"
    finally:
        trainer.close()


def test_stop_signals_reach_the_handler_and_the_previous_handlers_come_back():
    from lora_worker.host.process_host import ProcessHost

    before = signal.getsignal(signal.SIGTERM)
    got: list[int] = []
    restore = ProcessHost().on_stop_signals(got.append)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: got, what="the handler")
    finally:
        restore()
    assert got == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is before


def test_an_exit_status_is_worded_one_way_for_the_log_and_the_error():
    assert [processes.decode_wait_status(rc) for rc in (0, 2, -9, -77, None)] == [
        "exit status 0", "exit status 2", "killed by SIGKILL", "killed by signal 77", "no exit status"]
    assert processes.split_wait_status(-15) == (None, 15) and processes.split_wait_status(1) == (1, None)


@pytest.mark.slow
def test_descendants_are_listed_from_proc_through_a_new_session_and_zombies_left_out():
    # A child, and its child in a session of its own (as a daemonising trainer would): both descend from us.
    code = ("import os, subprocess, sys, time\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True)\n"
            "print(g.pid, flush=True)\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        grandchild = int(child.stdout.readline())  # type: ignore[union-attr]
        wait_for(lambda: exited(dead.pid), what="the zombie")
        found = {p.pid: p for p in processes.live_descendants(os.getpid())}
        assert {child.pid, grandchild} <= set(found) and dead.pid not in found
        assert found[grandchild].start_ticks == processes.start_ticks(grandchild)
        processes.kill_all([found[grandchild]], signal.SIGKILL)
        wait_for(lambda: processes.state_of(grandchild) in (None, "Z"), what="the grandchild killed")
        stale = processes.Identity(processes.boot_id(), child.pid, found[child.pid].start_ticks + 1)
        processes.kill_all([stale], signal.SIGKILL)  # not the process listed (a reused pid): left alone
        assert processes.state_of(child.pid) not in (None, "Z")
    finally:
        child.kill()
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]
        dead.wait()


@pytest.mark.slow
def test_a_flood_is_taken_a_pipeful_per_read_from_an_enlarged_pipe_in_order(tmp_path):
    import fcntl
    from pathlib import Path

    from lora_worker.host.process_host import DRAIN_BYTES, PIPE_BYTES, READ_BYTES, ProcessHost

    code = ("import os, sys\n"
            "for i in range(16): os.write(1, bytes([65 + i]) * 65536)\n")
    trainer = ProcessHost().spawn([sys.executable, "-c", code], cwd=tmp_path, env={})
    try:
        granted = fcntl.fcntl(trainer._fd, fcntl.F_GETPIPE_SZ)
        assert granted >= min(PIPE_BYTES, int(Path("/proc/sys/fs/pipe-max-size").read_text()))
        wait_for(lambda: trainer.poll() is not None, what="the writer's exit")  # its 1 MiB waits in the pipe
        chunks = []
        while (data := trainer.read(0.05)) is not None:
            chunks.append(data)
        assert b"".join(chunks) == b"".join(bytes([65 + i]) * 65536 for i in range(16))
        assert max(map(len, chunks)) > READ_BYTES and max(map(len, chunks)) <= DRAIN_BYTES
    finally:
        trainer.close()

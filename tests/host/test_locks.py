"""The lock files: as open as their directory, taken read-only, never through a link or a FIFO, and their holder
found in /proc/locks."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lora_worker.host.locks import (GPU_LOCK_DIR_MODE_EVERYONE, GPU_LOCK_DIR_MODE_GROUP, NotALockFile,
                                    flock_holder, gpu_lock_dir_mode, hold_lock, is_locked, lock_file_mode,
                                    lock_state)
from tests.helpers import install_script


@pytest.fixture
def umask_077():
    old = os.umask(0o077)  # stricter than the unit's 0007: the lock's mode must not depend on it
    yield
    os.umask(old)


def holder(path: Path) -> subprocess.Popen[bytes]:
    """Another process that takes the lock and keeps it."""
    proc = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDONLY | os.O_CREAT, 0o644)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)")], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout:
        proc.stdout.close()


@pytest.mark.parametrize("dir_mode, file_mode", [
    (0o3770, 0o660), (0o1777, 0o666), (0o0750, 0o640), (0o0700, 0o600), (0o0755, 0o644)])
def test_a_lock_file_is_as_open_as_its_directory(dir_mode, file_mode):
    assert lock_file_mode(dir_mode) == file_mode


def test_a_new_lock_file_gets_its_directorys_openness_whatever_the_umask(tmp_path, umask_077):
    locks = tmp_path / "gpu"
    locks.mkdir()
    locks.chmod(GPU_LOCK_DIR_MODE_GROUP)
    fd = hold_lock(locks / "gpu-1.lock")
    assert fd is not None
    os.close(fd)
    assert stat.S_IMODE((locks / "gpu-1.lock").stat().st_mode) == 0o660


def test_the_settings_choose_the_group_or_everyone_and_the_installer_agrees(settings):
    from dataclasses import replace
    assert gpu_lock_dir_mode(settings) == GPU_LOCK_DIR_MODE_GROUP == 0o3770
    assert gpu_lock_dir_mode(replace(settings, gpu_lock_everyone=True)) == GPU_LOCK_DIR_MODE_EVERYONE == 0o1777
    assert install_script().GPU_LOCK_DIR_MODE == {"group": 0o3770, "everyone": 0o1777}


def test_a_link_planted_as_a_lock_is_never_followed_and_counts_as_held(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    link = tmp_path / "gpu-1.lock"
    link.symlink_to(target)
    with pytest.raises(NotALockFile):
        hold_lock(link)
    assert is_locked(link) is True  # nobody can take it: the device is not free
    dangling = tmp_path / "gpu-2.lock"
    dangling.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(NotALockFile):
        hold_lock(dangling)
    assert not (tmp_path / "would-be-created").exists() and target.read_text() == "keep"


def test_a_fifo_planted_as_a_lock_never_blocks(tmp_path):
    fifo = tmp_path / "gpu-1.lock"
    os.mkfifo(fifo)
    outcome: list[object] = []

    def attempt() -> None:
        try:
            hold_lock(fifo)
        except NotALockFile as exc:
            outcome.append(exc)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive() and isinstance(outcome[0], NotALockFile)  # an O_RDONLY open would hang here
    assert is_locked(fifo) is True


@pytest.mark.slow
def test_lock_state_names_the_pid_that_holds_the_lock(tmp_path):
    path = tmp_path / "gpu-1.lock"
    assert lock_state(path) == lock_state(path).__class__(False, None)  # absent: free
    proc = holder(path)
    try:
        state = lock_state(path)
        assert state.held is True and state.holder_pid == proc.pid
    finally:
        stop(proc)
    assert lock_state(path).held is False and lock_state(path).holder_pid is None


def test_proc_locks_waiters_and_shared_probes_are_not_holders(tmp_path):
    proc_locks = tmp_path / "locks"
    dev = os.makedev(0xFE, 0x00)
    proc_locks.write_text(
        "1: FLOCK  ADVISORY  READ  111 fe:00:42 0 EOF\n"
        "2: -> FLOCK  ADVISORY  WRITE 222 fe:00:42 0 EOF\n"
        "3: POSIX  ADVISORY  WRITE 333 fe:00:42 0 EOF\n"
        "4: FLOCK  ADVISORY  WRITE 444 fe:01:42 0 EOF\n")
    assert flock_holder(dev, 42, proc_locks) is None
    proc_locks.write_text(proc_locks.read_text() + "5: FLOCK  ADVISORY  WRITE 555 fe:00:42 0 EOF\n")
    assert flock_holder(dev, 42, proc_locks) == 555

"""The GPU interlock across users (as root, with throwaway accounts): a second, unprivileged trainer in the
configured group is blocked by a running job and blocks a new one (409 `gpu_locked`); a user outside the group
cannot touch the lock unless the interlock is open to everyone; /gpu-status names the holder."""
from __future__ import annotations

import grp
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker import create_app
from lora_worker.host.locks import gpu_lock_dir_mode, gpu_lock_path, hold_lock
from tests.helpers.api import assert_refused
from tests.helpers import set_modes, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None,
                       reason="runs a second trainer as a real unprivileged user: needs root, useradd, setpriv"),
]
CONFLICT = 99  # flock(1)'s exit status when the lock is held (-E), distinct from a permission error


@pytest.fixture
def users():
    tag = secrets.token_hex(3)
    names = {"group": f"lwi{tag}", "member": f"lwm{tag}", "outsider": f"lwo{tag}"}
    subprocess.run(["groupadd", "--system", names["group"]], check=True)
    subprocess.run(["useradd", "--system", "--no-create-home", "--groups", names["group"], names["member"]], check=True)
    subprocess.run(["useradd", "--system", "--no-create-home", names["outsider"]], check=True)
    yield names
    for user in (names["member"], names["outsider"]):
        subprocess.run(["userdel", "--force", user], capture_output=True)
        subprocess.run(["groupdel", user], capture_output=True)
    subprocess.run(["groupdel", names["group"]], capture_output=True)


def lock_dir(settings, group: str) -> Path:
    """The GPU lock directory as the installer's tmpfiles entry makes it, under a path every user can walk."""
    base = Path(tempfile.mkdtemp(prefix="lw-locks-", dir="/tmp"))
    base.chmod(0o755)
    directory = base / "gpu"
    directory.mkdir()
    os.chown(directory, 0, grp.getgrnam(group).gr_gid)
    directory.chmod(gpu_lock_dir_mode(settings))
    return directory


@pytest.fixture
def interlock(migrated, users):
    settings = replace(migrated, gpu_lock_group=users["group"])
    directory = lock_dir(settings, users["group"])
    settings = replace(settings, gpu_lock_dir=directory)
    yield settings
    shutil.rmtree(directory.parent)


def as_user(user: str, *argv: str, **popen: object) -> subprocess.Popen[bytes]:
    # setpriv execs in place (no fork, unlike runuser): the Popen pid is the pid that takes the lock.
    return subprocess.Popen(["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups",
                             *argv], **popen)  # type: ignore[call-overload]


def try_lock(user: str, path: Path) -> int:
    """flock -n as `user`: 0 taken, CONFLICT held by someone, anything else refused (permission)."""
    proc = as_user(user, "flock", "-n", "-E", str(CONFLICT), str(path), "true", stderr=subprocess.DEVNULL)
    return proc.wait(timeout=30)


def test_a_second_user_in_the_group_is_blocked_while_a_job_runs_and_may_lock_once_it_ended(interlock, host, users):
    app = create_app(interlock)
    client = app.test_client()
    try:
        set_modes(host.sd_scripts, hang_in="training")
        job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
        wait_for(lambda: client.get(f"/train/{job_id}").get_json()["phase"] == "training", what="training")
        lock = gpu_lock_path(interlock, 1)
        assert oct(lock.stat().st_mode & 0o777) == oct(0o660)  # the worker's file is the group's to open
        assert try_lock(users["member"], lock) == CONFLICT  # EWOULDBLOCK, not EACCES: the member joined
        assert try_lock(users["outsider"], lock) not in (0, CONFLICT)  # outside the group: cannot even open it
        status = client.get("/gpu-status").get_json()["devices"][1]["lock"]
        supervisor = client.get(f"/train/{job_id}").get_json()
        assert status["held"] is True and status["ours"] is True and status["holder_pid"] is not None
        assert client.get("/gpu-status").get_json()["devices"][0]["lock"] == {
            "held": False, "holder_pid": None, "holder_name": None, "ours": False}
        assert client.post(f"/train/{job_id}/cancel").status_code == 202
        wait_for(lambda: client.get(f"/train/{job_id}").get_json()["status"] == "cancelled", what="cancelled")
        assert supervisor["status"] == "running"
        assert try_lock(users["member"], lock) == 0  # free again, for the other trainer
    finally:
        app.extensions["lora_worker"].db.dispose()


def test_a_second_user_holding_the_lock_makes_post_train_a_409_and_gpu_status_names_it(interlock, host, users,
                                                                                    launches):
    client = create_app(interlock, launch=launches).test_client()
    lock = gpu_lock_path(interlock, 1)
    other = as_user(users["member"], "flock", str(lock), "sleep", "60",  # the other trainer made the file, 0644
                    start_new_session=True)
    try:
        wait_for(lambda: client.get("/gpu-status").get_json()["devices"][1]["lock"]["held"], what="held")
        status = client.get("/gpu-status").get_json()["devices"][1]["lock"]
        assert (status["holder_pid"], status["holder_name"], status["ours"]) == (other.pid, "flock", False)
        assert lock.stat().st_uid == pwd.getpwnam(users["member"]).pw_uid
        body = assert_refused(client.post("/train", json=host.payload()), 409, "gpu_locked", interlock, launches)
        assert body["retryable"] is True
    finally:
        os.killpg(other.pid, 9)  # flock and its sleep, which holds the lock too (it inherited the fd)
        other.wait()
    wait_for(lambda: not client.get("/gpu-status").get_json()["devices"][1]["lock"]["held"], what="released")
    assert client.post("/train", json=host.payload()).status_code == 202


def test_a_service_user_takes_a_lock_file_another_trainer_made_read_only_for_it(interlock, users):
    lock = gpu_lock_path(interlock, 1)
    made = as_user(users["member"], "sh", "-c", f"umask 022; : > {lock}")  # 0644: not writable by the group
    assert made.wait(timeout=30) == 0 and oct(lock.stat().st_mode & 0o777) == oct(0o644)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker's own code, as an unprivileged member of the group (no exec: no interpreter to reach)
        code = 1
        try:
            os.close(read)
            os.setgroups([grp.getgrnam(users["group"]).gr_gid])
            os.setgid(grp.getgrnam(users["group"]).gr_gid)
            os.setuid(pwd.getpwnam(users["outsider"]).pw_uid)  # another uid than the file's owner
            fd = hold_lock(lock)
            os.write(write, b"locked" if fd is not None else b"held")
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised in a forked pytest
            os.write(write, repr(exc).encode()[:200])
        finally:
            os._exit(code)
    os.close(write)
    answer = os.read(read, 256)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"locked"


def test_with_gpu_lock_everyone_a_user_outside_every_group_may_join(migrated, users):
    settings = replace(migrated, gpu_lock_everyone=True)
    directory = lock_dir(settings, users["group"])
    try:
        assert oct(directory.stat().st_mode & 0o7777) == oct(0o1777)
        fd = hold_lock(directory / "gpu-1.lock")  # the worker makes the file, 0666
        assert fd is not None and oct((directory / "gpu-1.lock").stat().st_mode & 0o777) == oct(0o666)
        assert try_lock(users["outsider"], directory / "gpu-1.lock") == CONFLICT
        os.close(fd)
        assert try_lock(users["outsider"], directory / "gpu-1.lock") == 0
        assert try_lock(users["outsider"], directory / "gpu-0.lock") == 0  # and may create a lock file itself
    finally:
        shutil.rmtree(directory.parent)

"""`lora-worker doctor` as the service user (as root, with throwaway accounts): it can exec the trainer, read the
models, and make a folder in the train root that arbo's user can read; arbo's user is in the group; the GPU
lock directory lets the configured trainers join. Each check fails when its promise is broken."""
from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker.ops.doctor import identity_checks
from tests.helpers import make_host

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="runs the checks as a real unprivileged user: needs root and useradd")


@pytest.fixture
def users():
    tag = secrets.token_hex(3)
    names = {"group": f"lwd{tag}", "service": f"lwds{tag}", "arbo": f"lwda{tag}", "stranger": f"lwdx{tag}"}
    subprocess.run(["groupadd", "--system", names["group"]], check=True)
    for user in ("service", "arbo"):
        subprocess.run(["useradd", "--system", "--no-create-home", "--groups", names["group"], names[user]],
                       check=True)
    subprocess.run(["useradd", "--system", "--no-create-home", names["stranger"]], check=True)
    yield names
    for user in ("service", "arbo", "stranger"):
        subprocess.run(["userdel", "--force", names[user]], capture_output=True)
        subprocess.run(["groupdel", names[user]], capture_output=True)
    subprocess.run(["groupdel", names["group"]], capture_output=True)


@pytest.fixture
def deployed(users):
    """A host laid out as the installer leaves it, under a path every user can walk."""
    base = Path(tempfile.mkdtemp(prefix="lw-doctor-", dir="/tmp"))
    base.chmod(0o755)
    host = make_host(base)
    gid = grp.getgrnam(users["group"]).gr_gid
    accelerate = host.settings.accelerate
    accelerate.write_text("#!/bin/sh\nexit 0\n")  # an interpreter every user can reach (not pytest's python)
    os.chown(host.settings.train_root, 0, gid)
    host.settings.train_root.chmod(0o2770)
    locks = base / "gpu-locks"
    locks.mkdir()
    os.chown(locks, 0, gid)
    locks.chmod(0o3770)
    settings = replace(host.settings, arbo_user=users["arbo"], gpu_lock_group=users["group"], gpu_lock_dir=locks)
    yield settings
    shutil.rmtree(base)


def checks_as(user: str, settings) -> dict[str, tuple[bool, str]]:
    """identity_checks run in a child that is `user`, with that user's groups: name prefix → (ok, detail)."""
    entry = pwd.getpwnam(user)
    groups = [g.gr_gid for g in grp.getgrall() if user in g.gr_mem]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # no exec: the checks' own code, as that user
        try:
            os.close(read)
            os.setgroups(groups)
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            os.umask(0o007)  # the unit's
            found = [(c.name, c.ok, c.detail) for c in identity_checks(settings)]
            os.write(write, json.dumps(found).encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return {name.split(" /")[0]: (ok, detail) for name, ok, detail in json.loads(b"".join(chunks))}


@pytest.mark.slow
def test_on_a_host_laid_out_as_installed_every_identity_check_passes(deployed, users):
    found = checks_as(users["service"], deployed)
    assert found["running as"] == (True, f"{users['service']} (uid {pwd.getpwnam(users['service']).pw_uid})")
    for name in ("trainer exec", "models readable", f"arbo's user {users['arbo']}", "train root shared",
                 "gpu interlock"):
        assert found[name][0] is True, (name, found[name])
    assert "the group can read it" in found["train root shared"][1]


def _venv_private(settings, users):
    settings.accelerate.parent.chmod(0o700)
    return settings


def _model_private(settings, users):
    next(settings.model_dirs[0].glob("*.safetensors")).chmod(0o600)
    return settings


def _arbo_outside(settings, users):
    return replace(settings, arbo_user=users["stranger"])


def _no_setgid(settings, users):
    settings.train_root.chmod(0o0770)  # the service user can still write, but new folders get its own group
    return settings


def _lock_dir_closed(settings, users):
    settings.gpu_lock_dir.chmod(0o0750)
    return settings


@pytest.mark.parametrize("breakage, check, says", [
    (_venv_private, "trainer exec", "cannot read and execute it"),
    (_model_private, "models readable", "0/1 checkpoint(s) readable"),
    (_arbo_outside, "arbo's user", "NOT in"),
    (_no_setgid, "train root shared", "not the root's"),
    (_lock_dir_closed, "gpu interlock", "mode 0750, not 3770"),
], ids=lambda v: getattr(v, "__name__", None) or str(v)[:20])
@pytest.mark.slow
def test_each_identity_check_fails_when_its_promise_is_broken(deployed, users, breakage, check, says):
    settings = breakage(deployed, users)
    found = checks_as(users["service"], settings)
    (key,) = [name for name in found if name.startswith(check)]
    ok, detail = found[key]
    assert ok is False and says in detail, (key, detail)


@pytest.mark.slow
def test_in_a_checkout_without_arbo_user_or_a_shared_lock_dir_those_checks_only_warn(deployed, users):
    checkout = replace(deployed, arbo_user=None, gpu_lock_dir=None)
    checkout.train_root.chmod(0o0770)  # not shared either: a folder there stays the service user's
    by_name = {c.name.split(" /")[0]: c for c in identity_checks(checkout)}
    for name in ("arbo's user", "train root shared", "gpu interlock"):
        assert by_name[name].ok is False and by_name[name].required is False, by_name[name]
    assert by_name["trainer exec"].required is True

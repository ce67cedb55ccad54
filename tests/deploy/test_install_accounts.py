"""systemd/install.py with real accounts (as root, throwaway names): it makes the group, adds the service user and
arbo's user to it, owns the train root by the group, and never creates a service user that cannot exec the
trainer's venv, nor runs as an existing one that cannot."""
from __future__ import annotations

import grp
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lora_worker.config import REPO_ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # an install builds a venv from the lock (tests/helpers/deploy.py)
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                       reason="creates real users and groups: needs root and useradd"),
]
SCRIPT = REPO_ROOT / "systemd" / "install.py"


class Accounts:
    """Unique throwaway names, and the removal of whatever the test or the installer made of them."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.group, self.service, self.arbo = f"lwg{tag}", f"lws{tag}", f"lwa{tag}"
        self.arbo_uid = next(uid for uid in range(61000, 62000) if not _uid_taken(uid))

    def cleanup(self) -> None:
        for user in (self.service, self.arbo):
            subprocess.run(["userdel", "--force", user], capture_output=True)
        for group in (self.group, self.service, self.arbo):
            subprocess.run(["groupdel", group], capture_output=True)

    def flags(self, trainer_venv: Path) -> list[str]:
        return ["--accounts", "--service-user", self.service, "--group", self.group, "--arbo-user", self.arbo,
                "--arbo-uid", str(self.arbo_uid), "--trainer-venv", str(trainer_venv)]


def _uid_taken(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _exists(user: str) -> bool:
    return _uid_of(user) is not None


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def groups_of(user: str) -> set[str]:
    return set(subprocess.run(["id", "-nG", user], capture_output=True, text=True, check=True).stdout.split())


@pytest.fixture
def accounts():
    made = Accounts()
    yield made
    made.cleanup()


@pytest.fixture
def root():
    # Under /tmp, not pytest's 0700 tmp dir: the new users must be able to walk to the staged trainer.
    path = Path(tempfile.mkdtemp(prefix="lw-install-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def trainer(root: Path, venv_mode: int, group: str | None = None) -> Path:
    """A trainer venv at <root>/opt/fluxgym/.venv whose bin/accelerate is a shell script (as root:root 0755)."""
    venv = root / "opt/fluxgym/.venv"
    (venv / "bin").mkdir(parents=True)
    accelerate = venv / "bin/accelerate"
    accelerate.write_text("#!/bin/sh\nexit 0\n")
    accelerate.chmod(0o755)
    for path in (root / "opt", root / "opt/fluxgym", venv / "bin"):
        path.chmod(0o755)
    if group:
        os.chown(venv, 0, grp.getgrnam(group).gr_gid)
    venv.chmod(venv_mode)
    return venv


def install(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--no-systemctl", *flags],
                          capture_output=True, text=True, timeout=600)


def test_a_service_user_that_could_not_exec_the_trainer_is_never_created(root, accounts):
    venv = trainer(root, 0o700)  # root's alone: nobody new could enter it
    result = install(root, *accounts.flags(Path("/opt/fluxgym/.venv")))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"refusing to create {accounts.service}" in result.stderr and str(venv.relative_to(root)) in result.stderr
    assert not _exists(accounts.service) and not _exists(accounts.arbo)  # nothing was made before the refusal
    assert not (root / "etc").exists() and not (root / "opt/lora-training-worker").exists()


def test_an_existing_service_user_that_cannot_exec_the_trainer_is_refused(root, accounts):
    subprocess.run(["useradd", "--system", "--no-create-home", accounts.service], check=True)
    trainer(root, 0o700)
    result = install(root, *accounts.flags(Path("/opt/fluxgym/.venv")))
    assert result.returncode == 2 and f"{accounts.service} cannot exec the trainer" in result.stderr, result.stderr
    assert not (root / "etc").exists()


def test_the_install_makes_the_group_and_both_users_members_and_the_train_root_the_groups(root, accounts):
    subprocess.run(["groupadd", "--system", accounts.group], check=True)
    trainer(root, 0o750, group=accounts.group)  # the group may run the trainer: a new member can exec it
    first = install(root, *accounts.flags(Path("/opt/fluxgym/.venv")))
    assert first.returncode == 0, first.stdout + first.stderr
    assert accounts.group in groups_of(accounts.service) and accounts.group in groups_of(accounts.arbo)
    assert _uid_of(accounts.arbo) == accounts.arbo_uid
    # The kernel agrees: the new service user really can exec the trainer.
    accelerate = root / "opt/fluxgym/.venv/bin/accelerate"
    assert subprocess.run(["runuser", "-u", accounts.service, "--", str(accelerate)]).returncode == 0
    train_root = (root / "worktank/arbo/train").stat()
    assert (train_root.st_uid, grp.getgrgid(train_root.st_gid).gr_name) == (0, accounts.group)
    assert stat.S_IMODE(train_root.st_mode) == 0o2770
    config = (root / "etc/lora-worker/worker.toml").stat()
    assert grp.getgrgid(config.st_gid).gr_name == grp.getgrgid(pwd.getpwnam(accounts.service).pw_gid).gr_name
    unit = (root / "etc/systemd/system/lora-worker.service").read_text()
    assert f"User={accounts.service}\n" in unit and f"SupplementaryGroups={accounts.group}\n" in unit
    tmpfiles = (root / "etc/tmpfiles.d/lora-worker.conf").read_text()
    assert f"d /run/lock/gpu 3770 root {accounts.group} -" in tmpfiles
    second = install(root, *accounts.flags(Path("/opt/fluxgym/.venv")))
    assert second.returncode == 0 and "0 change(s)" in second.stdout, second.stdout + second.stderr


def test_an_existing_arbo_user_outside_the_group_is_added_and_a_taken_uid_is_refused(root, accounts):
    subprocess.run(["groupadd", "--system", accounts.group], check=True)
    subprocess.run(["useradd", "--system", "--no-create-home", accounts.arbo], check=True)
    trainer(root, 0o755)
    taken = Accounts()
    try:  # a fresh name for arbo's user, on a uid someone has: never a second user on the same uid
        result = install(root, *taken.flags(Path("/opt/fluxgym/.venv")), "--arbo-uid", str(_uid_of(accounts.arbo)))
        assert result.returncode == 2 and f"belongs to {accounts.arbo}" in result.stderr, result.stderr
    finally:
        taken.cleanup()
    result = install(root, *accounts.flags(Path("/opt/fluxgym/.venv")))
    assert result.returncode == 0, result.stdout + result.stderr
    assert accounts.group in groups_of(accounts.arbo) and f"{accounts.arbo} joins {accounts.group}" in result.stdout

#!/usr/bin/env python3
"""Install or update lora-worker on this host, idempotently (deploy/lora-worker.yml drives it from a playbook).

    sudo python3 systemd/install.py                  # from a checkout of the repository, the seed's identities

The identities are flags with the seed's values as defaults: the service user (`llmuser`, the user that can
exec the trainer's venv), the shared group (`arbotrain`), arbo's user (`lkraven`, uid 1000), the code prefix
(`/opt/lora-training-worker`), the train root (`/worktank/arbo/train`) and the trainer's venv
(`/opt/fluxgym/.venv`). It creates the group, adds the service user and arbo's user to it (creating arbo's user
if absent, and the service user only if a new user could exec the trainer: never one that cannot), the train
root (group-owned, setgid 2770), a copy of the code in the prefix with a venv built from
deploy/requirements.lock (`--require-hashes`: every dependency, transitive ones too, pinned by hash),
/etc/lora-worker/worker.toml and the API token (each only if absent: never overwritten), the unit and its
tmpfiles.d entry (the GPU lock directory, open to the interlock's group or to everyone), the ledger check's unit
and its daily timer, and the `lora-worker` command; then enables and (re)starts the service, enables and starts
the timer, and waits until GET /healthz answers 200. A second run changes nothing that is already right.

--root DIR writes every path under DIR (for staging and for CI). Accounts are host-wide, so under --root they
are neither created nor assigned unless --accounts says so (the tests do, as root, with throwaway names).
--no-systemctl skips systemctl and the health gate. --dry-run prints every change it would make (each
`would:` line) and makes none. Standard library only: this runs before the venv exists.
"""
from __future__ import annotations

import argparse
import grp
import hashlib
import json
import os
import pwd
import re
import secrets
import shlex
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also when loaded by a test
import install_bytecode as bytecode  # noqa: E402

SOURCE = Path(__file__).resolve().parent.parent
LOCK = SOURCE / "deploy" / "requirements.lock"
CONFIG_DIR = Path("/etc/lora-worker")
CONFIG, TOKEN = CONFIG_DIR / "worker.toml", CONFIG_DIR / "api_token"
UNIT = Path("/etc/systemd/system/lora-worker.service")
# The ledger's full integrity check, once a day (no service start pays for reading the whole file).
CHECK_UNIT = Path("/etc/systemd/system/lora-worker-check.service")
CHECK_TIMER = Path("/etc/systemd/system/lora-worker-check.timer")
# The webhook sender (lora_worker/webhooks/): skipped by its unit's condition until a webhook secret exists.
WEBHOOKS_UNIT = Path("/etc/systemd/system/lora-worker-webhooks.service")
TMPFILES = Path("/etc/tmpfiles.d/lora-worker.conf")
COMMAND = Path("/usr/local/bin/lora-worker")
STATE_DIR = Path("/var/lib/lora-worker")
HEALTH_URL = "http://127.0.0.1:8203/healthz?deep=1"  # 200 only once the deep checks found the host can train
# What the service needs of the repository: the package, the migrations (found next to it), the unit files, and
# the docs the README and the units point to.
CODE = ("lora_worker", "migrations", "systemd", "setup.cfg", "pyproject.toml", "README.md", "docs")
# The GPU lock directory's mode, as lora_worker.host.locks wants it (a test holds the two together).
GPU_LOCK_DIR_MODE = {"group": 0o3770, "everyone": 0o1777}
PLACEHOLDER = re.compile(r"@[A-Z_]+@")


class InstallError(Exception):
    """A step that must not go ahead; nothing after it has been done."""


@dataclass(frozen=True)
class Identities:
    """Who and where, with the seed's values as defaults."""

    service_user: str = "llmuser"
    group: str = "arbotrain"
    arbo_user: str = "lkraven"
    arbo_uid: int = 1000
    prefix: Path = Path("/opt/lora-training-worker")
    train_root: Path = Path("/worktank/arbo/train")
    trainer_venv: Path = Path("/opt/fluxgym/.venv")
    gpu_lock_dir: Path = Path("/run/lock/gpu")
    gpu_lock_group: str = ""  # empty: the shared group
    gpu_lock_everyone: bool = False
    model_dirs: tuple[str, ...] = field(default=("/worktank/models",))

    @property
    def lock_group(self) -> str:
        return self.gpu_lock_group or self.group

    @property
    def venv(self) -> Path:
        return self.prefix / "venv"

    @property
    def accelerate(self) -> Path:
        return self.trainer_venv / "bin" / "accelerate"

    @property
    def gpu_lock_mode(self) -> int:
        return GPU_LOCK_DIR_MODE["everyone" if self.gpu_lock_everyone else "group"]

    def placeholders(self) -> dict[str, str]:
        groups = [self.group] + ([self.lock_group] if self.lock_group != self.group else [])
        return {"@SERVICE_USER@": self.service_user, "@GROUPS@": " ".join(groups), "@PREFIX@": str(self.prefix),
                "@TRAIN_ROOT@": str(self.train_root), "@GPU_LOCK_DIR@": str(self.gpu_lock_dir),
                "@GPU_LOCK_MODE@": f"{self.gpu_lock_mode:04o}", "@GPU_LOCK_GROUP@": self.lock_group}


def worker_toml(ids: Identities) -> dict[str, object]:
    """The deployed settings: every key is a real setting of lora_worker.config."""
    trainer_home = ids.trainer_venv.parent  # fluxgym's layout: .venv/, sd-scripts/ and tokenizers/ side by side
    return {
        "bind": "0.0.0.0:8203",
        "state_dir": str(STATE_DIR),
        "train_root": str(ids.train_root),
        "gpu_lock_dir": str(ids.gpu_lock_dir),
        "gpu_lock_group": ids.lock_group,
        "gpu_lock_everyone": ids.gpu_lock_everyone,
        "arbo_user": ids.arbo_user,
        "model_dirs": list(ids.model_dirs),
        "accelerate": str(ids.accelerate),
        "sd_scripts_dir": str(trainer_home / "sd-scripts"),
        "tokenizer_cache_dir": str(trainer_home / "tokenizers"),
    }


def render(template: str, ids: Identities) -> str:
    text = template
    for name, value in ids.placeholders().items():
        text = text.replace(name, value)
    left = PLACEHOLDER.findall(text)
    if left:
        raise InstallError(f"unfilled placeholder(s) {sorted(set(left))} in a template")
    return text


def command_script(ids: Identities) -> str:
    return f"""#!/bin/sh
# lora-worker with the deployed configuration (written by lora-worker's systemd/install.py).
# It runs as {ids.service_user}, so files it creates in the state directory stay the service's.
if [ "$(id -u)" = 0 ]; then exec runuser -u {ids.service_user} -- "$0" "$@"; fi
export LORA_WORKER_CONFIG={CONFIG}
exec {ids.venv}/bin/lora-worker "$@"
"""


class Installer:
    def __init__(self, root: Path, ids: Identities, *, systemctl: bool, accounts: bool, pip_args: list[str],
                 dry_run: bool = False) -> None:
        self.root = root
        self.dry_run = dry_run
        self.ids = ids
        self.systemctl = systemctl
        self.pip_args = pip_args
        self.staged = root != Path("/")
        self.accounts_on = accounts or not self.staged
        self.changes: list[str] = []

    def at(self, path: Path) -> Path:
        return self.root / path.relative_to("/")

    # -- steps ---------------------------------------------------------------------------------------------

    def run(self, health_url: str, health_timeout: float) -> int:
        ids = self.ids
        self.accounts()  # first: a refusal here leaves the host as it was
        self.directory(ids.train_root, 0o2770, group=ids.group, keep_owner={ids.service_user, ids.arbo_user})
        self.code()
        self.venv()
        self.bytecode()
        service_group = self.primary_group(ids.service_user)
        self.directory(CONFIG_DIR, 0o750, group=service_group)
        self.file_once(CONFIG, config_text(ids), 0o640, group=service_group)
        self.token_readable_by_others()
        self.file_once(TOKEN, secrets.token_urlsafe(32) + "\n", 0o600, group="root")
        for unit in (UNIT, CHECK_UNIT, CHECK_TIMER, WEBHOOKS_UNIT):
            self.file(unit, render((SOURCE / "systemd" / f"{unit.name}.in").read_text(), ids), 0o644)
        self.file(TMPFILES, render((SOURCE / "systemd" / "lora-worker.tmpfiles.conf.in").read_text(), ids), 0o644)
        self.file(COMMAND, command_script(ids), 0o755)
        print(f"{len(self.changes)} change(s)" + (" (dry run: none made)" if self.dry_run else "")
              + ("" if self.changes else ": everything was already in place"))
        if self.dry_run:
            print("skipped: systemctl and the health gate (--dry-run)")
            return 0
        if not self.systemctl:
            print("skipped: systemctl and the health gate (--no-systemctl)")
            return 0
        self.start_service()
        return 0 if health_gate(health_url, health_timeout) else 1

    def accounts(self) -> None:
        ids = self.ids
        if not self.accounts_on:
            print(f"skipped under --root: group {ids.group}, users {ids.service_user} and {ids.arbo_user} "
                  "(accounts are host-wide; --accounts makes them)")
            return
        create_service_user = self.check_service_user()  # both checks before any change
        self.check_arbo_uid()
        for group in dict.fromkeys((ids.group, ids.lock_group)):
            if not _exists("group", group):
                self.command(["groupadd", "--system", group], f"group {group}")
        if create_service_user:
            self.create_service_user()
        if not _exists("passwd", ids.arbo_user):
            self.command(["useradd", "--uid", str(ids.arbo_uid), "--user-group", "--groups", ids.group,
                          "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                          ids.arbo_user], f"user {ids.arbo_user} (uid {ids.arbo_uid})")
        for user in (ids.service_user, ids.arbo_user):
            for group in dict.fromkeys((ids.group, ids.lock_group)):
                if group not in _groups_of(user):
                    self.command(["usermod", "--append", "--groups", group, user], f"{user} joins {group}")

    def check_service_user(self) -> bool:
        """Whether the service user must be created. It must be able to exec the trainer: it is that user's
        venv to run, so a user is never created (nor used) that cannot."""
        ids, accelerate = self.ids, self.at(self.ids.accelerate)
        if not accelerate.is_file():
            raise InstallError(f"the trainer is not installed: {ids.accelerate} is missing (install the trainer "
                               "first, or name its venv with --trainer-venv)")
        if _exists("passwd", ids.service_user):
            problem = exec_problem_for_user(ids.service_user, accelerate)
            if problem:
                raise InstallError(f"{ids.service_user} cannot exec the trainer: {problem}; run the worker as the "
                                   "user that can (--service-user), or give this one access")
            return False
        try:
            gids = {grp.getgrnam(ids.group).gr_gid}
        except KeyError:
            gids = set()  # a group made now owns no file yet
        problem = exec_problem(accelerate, uid=None, gids=gids)
        if problem:
            raise InstallError(
                f"refusing to create {ids.service_user}: a new user, even in {ids.group}, could not exec the trainer "
                f"({problem}); name the user that can with --service-user")
        return True

    def create_service_user(self) -> None:
        ids = self.ids
        self.command(["useradd", "--system", "--user-group", "--groups", ids.group, "--home-dir", str(STATE_DIR),
                      "--no-create-home", "--shell", "/usr/sbin/nologin", ids.service_user],
                     f"user {ids.service_user}")
        if self.dry_run:
            return
        problem = exec_problem_for_user(ids.service_user, self.at(ids.accelerate))
        if problem:  # an ACL or a mount option the mode bits did not show: undo, never leave such a user
            subprocess.run(["userdel", ids.service_user], check=False)
            raise InstallError(f"{ids.service_user} was created but cannot exec the trainer ({problem}); removed it")

    def check_arbo_uid(self) -> None:
        ids = self.ids
        if _exists("passwd", ids.arbo_user):
            return
        try:
            taken = pwd.getpwuid(ids.arbo_uid).pw_name
        except KeyError:
            return
        raise InstallError(f"arbo's user {ids.arbo_user} is absent and uid {ids.arbo_uid} belongs to {taken}; "
                           f"pass --arbo-user {taken} if that is arbo's, or another --arbo-uid")

    def primary_group(self, user: str) -> str:
        try:
            return grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name
        except KeyError:
            return user  # staged without accounts: ownership is not applied anyway

    def code(self) -> None:
        """Mirror the code into the install dir: write what differs, remove what the source no longer has."""
        prefix = self.ids.prefix
        target = self.at(prefix)
        self.directory(prefix, 0o755)
        wanted = {rel: (SOURCE / rel).read_bytes() for rel in _code_files(SOURCE)}
        for rel, data in sorted(wanted.items()):
            for parent in reversed(Path(rel).parents[:-1]):
                self.directory(prefix / parent, 0o755, quiet=True)
            self.file(prefix / rel, data, 0o644, quiet=True)
        for rel in sorted(set(_code_files(target)) - set(wanted)):
            if not self.dry_run:
                (target / rel).unlink()
            self.change(f"removed {prefix / rel}")

    def venv(self) -> None:
        venv = self.at(self.ids.venv)
        python = venv / "bin" / "python"
        if not python.exists():
            self.command([sys.executable, "-m", "venv", str(venv)], f"venv {self.ids.venv}")
        # Every dependency from the lock, each checked against its hashes, so two installs of one commit are the
        # same; then the worker itself, editable (the code runs from the prefix, where migrations/ is found),
        # built with the locked setuptools and no index. Reinstall only when the pins or entry points changed.
        stamp = venv / ".lora-worker-installed"
        wanted = hashlib.sha256(b"".join(p.read_bytes() for p in (SOURCE / "setup.cfg", SOURCE / "pyproject.toml",
                                                                    LOCK)))
        wanted_text = wanted.hexdigest() + "\n"
        if not stamp.exists() or stamp.read_text() != wanted_text:
            pip = [str(python), "-m", "pip", "install", "--quiet", *self.pip_args]
            self.command([*pip, "--require-hashes", "--no-deps", "-r", str(LOCK)], "pip install the lock")
            self.command([*pip, "--no-deps", "--no-build-isolation", "--no-index", "-e", str(self.at(self.ids.prefix))],
                         f"pip install -e {self.ids.prefix}")
            if not self.dry_run:
                stamp.write_text(wanted_text)

    def bytecode(self) -> None:
        """Compile the worker and its venv (install_bytecode.py says why), so that no start under the unit's
        read-only prefix compiles a module from source again."""
        venv = self.at(self.ids.venv)
        where = [self.at(self.ids.prefix / "lora_worker"), *sorted((venv / "lib").glob("python3*/site-packages"))]
        stale = bytecode.stale(where)
        code_written = any(c.startswith(("wrote", "removed")) and str(self.ids.prefix / "lora_worker") in c
                           for c in self.changes)  # in a dry run, the code on disk is still the old one
        if not stale and (venv / "bin" / "python").exists() and not (self.dry_run and code_written):
            return
        if not self.dry_run:
            print(f"run: {venv / 'bin/python'} -m compileall -q -j 0 (the code and the venv's site-packages)",
                  flush=True)
            problem = bytecode.compile_all(venv / "bin" / "python", where)
            if problem:
                raise InstallError(f"compiling the byte code failed: {problem}")
        self.change(f"compiled {len(stale)} module(s) to byte code" if stale and not self.dry_run
                    else "compile the code's and the venv's byte code")

    def token_readable_by_others(self) -> None:
        """The token is arbo's key to this host: a copy anyone on the host could read is made private (below,
        0600 root, as the unit's LoadCredential reads it), and said loudly: it may have been read already."""
        target = self.at(TOKEN)
        try:
            st = target.lstat()
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            raise InstallError(f"{TOKEN} is not a regular file (a link or other kind): replace it with a file")
        if st.st_mode & 0o077:
            print(f"WARNING: {TOKEN} was readable by others than root ({stat.filemode(st.st_mode)}): making it 0600; "
                  "anyone on this host may have read it, so rotate it (write a new token there, then give arbo "
                  "the new one)", file=sys.stderr)

    def start_service(self) -> None:
        self.command(["systemd-tmpfiles", "--create", str(TMPFILES)], "tmpfiles", record=False)
        self.command(["systemctl", "daemon-reload"], "daemon-reload", record=False)
        self.command(["systemctl", "enable", "lora-worker.service"], "enable", record=False)
        # --now starts the timer, not the check: the first full check runs at the timer's next time.
        self.command(["systemctl", "enable", "--now", CHECK_TIMER.name], "enable the ledger check's timer",
                     record=False)
        # A restart never stops training (KillMode=process), so new code or settings take effect now.
        verb = "restart" if self.changes else "start"
        self.command(["systemctl", verb, "lora-worker.service"], f"{verb} lora-worker", record=False, check=False)
        # Enabled always; it runs once /etc/lora-worker/webhook_secret exists (its ConditionPathExists=).
        self.command(["systemctl", "enable", WEBHOOKS_UNIT.name], "enable the webhook sender", record=False)
        self.command(["systemctl", "restart", WEBHOOKS_UNIT.name], "restart the webhook sender", record=False,
                     check=False)

    # -- primitives ----------------------------------------------------------------------------------------

    def directory(self, path: Path, mode: int, *, group: str | None = None, quiet: bool = False,
                  keep_owner: set[str] | None = None) -> None:
        target = self.at(path)
        if not target.is_dir():
            if self.dry_run:
                self.change(f"created {path} (mode {mode:04o})", quiet)
                return
            target.mkdir(parents=True)
            self.change(f"created {path}", quiet)
        self.mode_and_owner(path, mode, group, keep_owner)

    def file(self, path: Path, content: str | bytes, mode: int, *, group: str | None = None,
             quiet: bool = False) -> None:
        data = content.encode() if isinstance(content, str) else content
        target = self.at(path)
        if not target.is_file() or target.read_bytes() != data:
            if self.dry_run:
                self.change(f"wrote {path}", quiet)
                if not target.is_file():
                    return
            else:
                self._write(target, data, mode)
                self.change(f"wrote {path}", quiet)
        self.mode_and_owner(path, mode, group)

    def _write(self, target: Path, data: bytes, mode: int) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)  # /etc/systemd/system … exist on a real host
        tmp = target.with_name(f".{target.name}.new")
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)  # never a half-written unit or script

    def file_once(self, path: Path, content: str, mode: int, *, group: str) -> None:
        """Create a file only if it is absent (config, token): an operator's edits are never overwritten."""
        target = self.at(path)
        if target.exists():
            print(f"kept: {path} (exists)")
        elif self.dry_run:
            self.change(f"created {path} (mode {mode:04o})")
            return
        else:
            # O_EXCL with the final mode: a token is never readable by anyone else, not even for an instant.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "w") as fh:
                fh.write(content)
            self.change(f"created {path}")
        self.mode_and_owner(path, mode, group)

    def mode_and_owner(self, path: Path, mode: int, group: str | None, keep_owner: set[str] | None = None) -> None:
        target = self.at(path)
        if target.stat().st_mode & 0o7777 != mode:
            if not self.dry_run:
                os.chmod(target, mode)  # also sets setgid, which mkdir's mode would not
            self.change(f"mode {mode:04o} on {path}")
        if group is None or not self.accounts_on or os.geteuid() != 0:
            return
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            return  # only when the account step could not create it; the service start will say so
        st = target.stat()
        keep = {pwd.getpwnam(u).pw_uid for u in (keep_owner or ()) if _exists("passwd", u)}
        uid = st.st_uid if st.st_uid in keep else 0  # the train root may be a member's; anything else is root's
        if (st.st_uid, st.st_gid) != (uid, gid):
            if not self.dry_run:
                os.chown(target, uid, gid)
                os.chmod(target, mode)  # chown clears setgid
            self.change(f"owner {uid}:{group} on {path}")

    def command(self, argv: list[str], what: str, *, record: bool = True, check: bool = True) -> None:
        """Run a step; with check=False a failure is left for the health gate to report."""
        if self.dry_run:
            print(f"would run: {shlex.join(argv)}", flush=True)
        else:
            print(f"run: {shlex.join(argv)}", flush=True)
            subprocess.run(argv, check=check)
        if record:
            self.change(what)

    def change(self, what: str, quiet: bool = False) -> None:
        if self.dry_run and what in self.changes:
            return  # a directory not made yet is "created" once, not once per file in it
        self.changes.append(what)
        if not quiet or self.dry_run:  # a dry run prints every change, one by one
            print(f"{'would' if self.dry_run else 'changed'}: {what}")


def exec_problem(path: Path, *, uid: int | None, gids: set[int]) -> str | None:
    """Why a process with `uid` (None: a user not created yet, who owns nothing) and `gids` could not run the
    script at `path`, judged from the mode bits; None when it could. A script needs search on every directory
    above it, read and execute on itself, and execute on its interpreter (the `#!` line)."""
    def allowed(st: os.stat_result, bits: int) -> bool:
        if uid == 0:
            return not bits & 0o1 or bool(st.st_mode & 0o111) or stat.S_ISDIR(st.st_mode)
        shift = 6 if st.st_uid == uid else 3 if st.st_gid in gids else 0
        return (st.st_mode >> shift) & bits == bits

    def reachable(target: Path) -> str | None:
        for directory in reversed(target.parents):
            if not allowed(os.stat(directory), 0o1):
                return f"{directory} ({stat.filemode(os.stat(directory).st_mode)}) cannot be entered"
        return None

    problem = reachable(path)
    if problem:
        return problem
    st = os.stat(path)
    if not allowed(st, 0o5):
        return f"{path} ({stat.filemode(st.st_mode)}) cannot be read and executed"
    interpreter = _interpreter(path)
    if interpreter is not None:
        real = Path(os.path.realpath(interpreter))
        problem = reachable(real) or (None if allowed(os.stat(real), 0o1) else f"{real} cannot be executed")
        if problem:
            return f"its interpreter: {problem}"
    return None


def exec_problem_for_user(user: str, path: Path) -> str | None:
    """The same question asked of the kernel, as that user (ACLs and mount options included)."""
    interpreter = _interpreter(path) or path
    check = 'test -r "$1" && test -x "$1" && test -x "$2"'
    result = subprocess.run(["runuser", "-u", user, "--", "/bin/sh", "-c", check, "sh", str(path), str(interpreter)],
                            capture_output=True, text=True)
    return None if result.returncode == 0 else f"{path} or its interpreter {interpreter} is not executable by {user}"


def _interpreter(path: Path) -> str | None:
    with open(path, "rb") as fh:
        first = fh.readline(256)
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    return parts[0] if parts else None


def config_text(ids: Identities) -> str:
    # JSON strings and booleans are valid TOML for these plain values.
    lines = [f"{key} = {json.dumps(value)}" for key, value in worker_toml(ids).items()]
    return ("# lora-worker settings, written once by systemd/install.py and never overwritten; edit freely.\n"
            "# Every setting and its default: lora_worker/config.py. An unknown key stops the service.\n"
            "# The API token is not here: the unit passes /etc/lora-worker/api_token as a credential.\n"
            + "\n".join(lines) + "\n")


def health_gate(url: str, timeout_s: float) -> bool:
    """Wait until `url` answers 200; the install fails if the service does not come up."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - a fixed local URL
                if response.status == 200:
                    print(f"healthy: {url} answered 200")
                    return True
                last = f"status {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(getattr(exc, "reason", exc))
        time.sleep(0.5)
    print(f"NOT healthy after {timeout_s:g}s: {url}: {last}; see `journalctl -u lora-worker -n 50`", file=sys.stderr)
    return False


def _code_files(base: Path) -> list[str]:
    """The code's files under `base`, relative to it, without Python's byte-code caches."""
    files = []
    for name in CODE:
        top = base / name
        found = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        files += [str(p.relative_to(base)) for p in found if "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return files


def _exists(database: str, name: str) -> bool:
    return subprocess.run(["getent", database, name], capture_output=True).returncode == 0


def _groups_of(user: str) -> list[str]:
    return subprocess.run(["id", "-nG", user], capture_output=True, text=True, check=True).stdout.split()


def build_parser() -> argparse.ArgumentParser:
    defaults = Identities()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/"), help="write every path under this directory")
    parser.add_argument("--accounts", action="store_true", help="under --root, still create and assign the accounts")
    parser.add_argument("--no-systemctl", action="store_true", help="skip systemctl and the health gate")
    parser.add_argument("--dry-run", action="store_true", help="print every change it would make, make none")
    parser.add_argument("--pip-args", default="", help="extra arguments for pip install (quoted)")
    parser.add_argument("--health-url", default=HEALTH_URL)
    parser.add_argument("--health-timeout", type=float, default=60.0)
    who = parser.add_argument_group("identities (the seed's by default)")
    who.add_argument("--service-user", default=defaults.service_user, help="runs the worker and execs the trainer")
    who.add_argument("--group", default=defaults.group, help="the shared group of the train root")
    who.add_argument("--arbo-user", default=defaults.arbo_user, help="arbo's user, added to the group")
    who.add_argument("--arbo-uid", type=int, default=defaults.arbo_uid, help="its uid, if it must be created")
    who.add_argument("--prefix", type=Path, default=defaults.prefix, help="where the code and its venv go")
    who.add_argument("--train-root", type=Path, default=defaults.train_root)
    who.add_argument("--trainer-venv", type=Path, default=defaults.trainer_venv,
                     help="the trainer's venv (bin/accelerate); sd-scripts/ and tokenizers/ beside it")
    who.add_argument("--gpu-lock-dir", type=Path, default=defaults.gpu_lock_dir)
    who.add_argument("--gpu-lock-group", default="", help="who may join the GPU interlock (default: --group)")
    who.add_argument("--gpu-lock-everyone", action="store_true", help="let every user on the host join it")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if sys.version_info < (3, 11):  # noqa: UP036 - an older system python runs this and must say why it stops
        parser.error("lora-worker needs Python 3.11 or newer")
    root = args.root.resolve()
    if (root == Path("/") or args.accounts) and os.geteuid() != 0:
        parser.error("creating accounts or installing on this host needs root (or use --root DIR to stage)")
    for option in ("prefix", "train_root", "trainer_venv", "gpu_lock_dir"):
        if not getattr(args, option).is_absolute():
            parser.error(f"--{option.replace('_', '-')} must be an absolute path")
    ids = Identities(service_user=args.service_user, group=args.group, arbo_user=args.arbo_user,
                     arbo_uid=args.arbo_uid, prefix=args.prefix, train_root=args.train_root,
                     trainer_venv=args.trainer_venv, gpu_lock_dir=args.gpu_lock_dir,
                     gpu_lock_group=args.gpu_lock_group, gpu_lock_everyone=args.gpu_lock_everyone)
    installer = Installer(root, ids, systemctl=not args.no_systemctl, accounts=args.accounts,
                          pip_args=shlex.split(args.pip_args), dry_run=args.dry_run)
    try:
        return installer.run(args.health_url, args.health_timeout)
    except InstallError as exc:
        print(f"install.py: refused: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Install or update lora-worker on this host, idempotently (the role the elway playbook plays).

    sudo python3 systemd/install.py                  # from a checkout of the repository

Creates the `arbo` group and the `lora-worker` user, the train root (setgid 2770, group arbo), a copy of the
code in /opt/lora-worker with its venv, /etc/lora-worker/worker.toml and the API token (each only if absent:
never overwritten), the unit, its tmpfiles.d entry and the `lora-worker` command; then enables and (re)starts
the service and waits until GET /healthz answers 200. A second run changes nothing that is already right.

--root DIR writes every path under DIR (for staging and for CI). Accounts are host-wide, so under --root they
are neither created nor assigned: the script says what it skipped. --no-systemctl skips systemctl and the
health gate. Standard library only: this runs before the venv exists.
"""
from __future__ import annotations

import argparse
import grp
import hashlib
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent
USER, TRAIN_GROUP = "lora-worker", "arbo"
INSTALL_DIR = Path("/opt/lora-worker")
VENV = INSTALL_DIR / "venv"
CONFIG_DIR = Path("/etc/lora-worker")
CONFIG, TOKEN = CONFIG_DIR / "worker.toml", CONFIG_DIR / "api_token"
UNIT = Path("/etc/systemd/system/lora-worker.service")
TMPFILES = Path("/etc/tmpfiles.d/lora-worker.conf")
COMMAND = Path("/usr/local/bin/lora-worker")
TRAIN_ROOT = Path("/worktank/arbo/train")
HEALTH_URL = "http://127.0.0.1:8203/healthz"
# What the service needs of the repository: the package, the migrations (found next to it), the unit files.
CODE = ("lora_worker", "migrations", "systemd", "setup.cfg", "pyproject.toml", "README.md")

WORKER_TOML = {
    "bind": "0.0.0.0:8203",
    "state_dir": "/var/lib/lora-worker",
    "train_root": str(TRAIN_ROOT),
    "gpu_lock_dir": "/run/lock/gpu",
    "model_dirs": ["/worktank/models"],
    "accelerate": "/opt/fluxgym/.venv/bin/accelerate",
    "sd_scripts_dir": "/opt/fluxgym/sd-scripts",
    "tokenizer_cache_dir": "/opt/fluxgym/tokenizers",
}
COMMAND_SCRIPT = f"""#!/bin/sh
# lora-worker with the deployed configuration (written by lora-worker's systemd/install.py).
# It runs as {USER}, so files it creates in the state directory stay the service's.
if [ "$(id -u)" = 0 ]; then exec runuser -u {USER} -- "$0" "$@"; fi
export LORA_WORKER_CONFIG={CONFIG}
exec {VENV}/bin/lora-worker "$@"
"""


class Installer:
    def __init__(self, root: Path, *, systemctl: bool, pip_args: list[str]) -> None:
        self.root = root
        self.systemctl = systemctl
        self.pip_args = pip_args
        self.staged = root != Path("/")
        self.changes: list[str] = []

    def at(self, path: Path) -> Path:
        return self.root / path.relative_to("/")

    # -- steps ---------------------------------------------------------------------------------------------

    def run(self, health_url: str, health_timeout: float) -> int:
        self.accounts()
        self.directory(TRAIN_ROOT, 0o2770, group=TRAIN_GROUP)
        self.code()
        self.venv()
        self.directory(CONFIG_DIR, 0o750, group=USER)
        self.file_once(CONFIG, config_text(), 0o640, group=USER)
        self.file_once(TOKEN, secrets.token_urlsafe(32) + "\n", 0o600, group="root")
        self.file(UNIT, (SOURCE / "systemd" / "lora-worker.service").read_text(), 0o644)
        self.file(TMPFILES, (SOURCE / "systemd" / "lora-worker.tmpfiles.conf").read_text(), 0o644)
        self.file(COMMAND, COMMAND_SCRIPT, 0o755)
        print(f"{len(self.changes)} change(s)" + ("" if self.changes else ": everything was already in place"))
        if not self.systemctl:
            print("skipped: systemctl and the health gate (--no-systemctl)")
            return 0
        self.start_service()
        return 0 if health_gate(health_url, health_timeout) else 1

    def accounts(self) -> None:
        if self.staged:
            print(f"skipped under --root: group {TRAIN_GROUP}, user {USER} (accounts are host-wide)")
            return
        if not _exists("group", TRAIN_GROUP):
            self.command(["groupadd", "--system", TRAIN_GROUP], f"group {TRAIN_GROUP}")
        if not _exists("passwd", USER):
            self.command(["useradd", "--system", "--user-group", "--groups", TRAIN_GROUP, "--home-dir",
                          "/var/lib/lora-worker", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                         f"user {USER}")
        elif TRAIN_GROUP not in _groups_of(USER):
            self.command(["usermod", "--append", "--groups", TRAIN_GROUP, USER], f"{USER} joins {TRAIN_GROUP}")

    def code(self) -> None:
        """Mirror the code into the install dir: write what differs, remove what the source no longer has."""
        target = self.at(INSTALL_DIR)
        self.directory(INSTALL_DIR, 0o755)
        wanted = {rel: (SOURCE / rel).read_bytes() for rel in _code_files(SOURCE)}
        for rel, data in sorted(wanted.items()):
            for parent in reversed(Path(rel).parents[:-1]):
                self.directory(INSTALL_DIR / parent, 0o755, quiet=True)
            self.file(INSTALL_DIR / rel, data, 0o644, quiet=True)
        for rel in sorted(set(_code_files(target)) - set(wanted)):
            (target / rel).unlink()
            self.change(f"removed {INSTALL_DIR / rel}")

    def venv(self) -> None:
        python = self.at(VENV) / "bin" / "python"
        if not python.exists():
            self.command([sys.executable, "-m", "venv", str(self.at(VENV))], f"venv {VENV}")
        # Editable: the code runs from the install dir, where migrations/ is found. Reinstall only when what
        # pip reads (the pins, the entry points) changed; new modules are picked up without it.
        stamp = self.at(VENV) / ".lora-worker-installed"
        wanted = hashlib.sha256(b"".join((SOURCE / n).read_bytes() for n in ("setup.cfg", "pyproject.toml")))
        wanted_text = wanted.hexdigest() + "\n"
        if not stamp.exists() or stamp.read_text() != wanted_text:
            self.command([str(python), "-m", "pip", "install", "--quiet", *self.pip_args, "-e",
                          str(self.at(INSTALL_DIR))], f"pip install -e {INSTALL_DIR}")
            stamp.write_text(wanted_text)

    def start_service(self) -> None:
        self.command(["systemd-tmpfiles", "--create", str(TMPFILES)], "tmpfiles", record=False)
        self.command(["systemctl", "daemon-reload"], "daemon-reload", record=False)
        self.command(["systemctl", "enable", "lora-worker.service"], "enable", record=False)
        # A restart never stops training (KillMode=process), so new code or settings take effect now.
        verb = "restart" if self.changes else "start"
        self.command(["systemctl", verb, "lora-worker.service"], f"{verb} lora-worker", record=False, check=False)

    # -- primitives ----------------------------------------------------------------------------------------

    def directory(self, path: Path, mode: int, *, group: str | None = None, quiet: bool = False) -> None:
        target = self.at(path)
        if not target.is_dir():
            target.mkdir(parents=True)
            self.change(f"created {path}", quiet)
        self.mode_and_owner(path, mode, group)

    def file(self, path: Path, content: str | bytes, mode: int, *, group: str | None = None,
             quiet: bool = False) -> None:
        data = content.encode() if isinstance(content, str) else content
        target = self.at(path)
        if not target.is_file() or target.read_bytes() != data:
            target.parent.mkdir(parents=True, exist_ok=True)  # /etc/systemd/system … exist on a real host
            tmp = target.with_name(f".{target.name}.new")
            tmp.write_bytes(data)
            os.chmod(tmp, mode)
            os.replace(tmp, target)  # never a half-written unit or script
            self.change(f"wrote {path}", quiet)
        self.mode_and_owner(path, mode, group)

    def file_once(self, path: Path, content: str, mode: int, *, group: str) -> None:
        """Create a file only if it is absent (config, token): an operator's edits are never overwritten."""
        target = self.at(path)
        if target.exists():
            print(f"kept: {path} (exists)")
        else:
            # O_EXCL with the final mode: a token is never readable by anyone else, not even for an instant.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "w") as fh:
                fh.write(content)
            self.change(f"created {path}")
        self.mode_and_owner(path, mode, group)

    def mode_and_owner(self, path: Path, mode: int, group: str | None) -> None:
        target = self.at(path)
        if target.stat().st_mode & 0o7777 != mode:
            os.chmod(target, mode)  # also sets setgid, which mkdir's mode would not
            self.change(f"mode {mode:04o} on {path}")
        if group is None or self.staged or os.geteuid() != 0:
            return
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            return  # only when the account step could not create it; the service start will say so
        if (target.stat().st_uid, target.stat().st_gid) != (0, gid):
            os.chown(target, 0, gid)
            self.change(f"owner root:{group} on {path}")

    def command(self, argv: list[str], what: str, *, record: bool = True, check: bool = True) -> None:
        """Run a step; with check=False a failure is left for the health gate to report."""
        print(f"run: {shlex.join(argv)}", flush=True)
        subprocess.run(argv, check=check)
        if record:
            self.change(what)

    def change(self, what: str, quiet: bool = False) -> None:
        self.changes.append(what)
        if not quiet:
            print(f"changed: {what}")


def config_text() -> str:
    # JSON strings are valid TOML basic strings for these plain paths.
    lines = [f"{key} = {json.dumps(value)}" for key, value in WORKER_TOML.items()]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/"), help="write every path under this directory")
    parser.add_argument("--no-systemctl", action="store_true", help="skip systemctl and the health gate")
    parser.add_argument("--pip-args", default="", help="extra arguments for pip install (quoted)")
    parser.add_argument("--health-url", default=HEALTH_URL)
    parser.add_argument("--health-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if sys.version_info < (3, 11):
        parser.error("lora-worker needs Python 3.11 or newer")
    root = args.root.resolve()
    if root == Path("/") and os.geteuid() != 0:
        parser.error("installing on this host needs root (or use --root DIR to stage elsewhere)")
    installer = Installer(root, systemctl=not args.no_systemctl, pip_args=shlex.split(args.pip_args))
    return installer.run(args.health_url, args.health_timeout)


if __name__ == "__main__":
    sys.exit(main())

"""deploy/requirements.lock read as data: every pin with its hashes."""
from __future__ import annotations

import re

from lora_worker.config import REPO_ROOT
from pathlib import Path
import sys
import subprocess
import stat
import shutil
import os
import hashlib

LOCK = REPO_ROOT / "deploy" / "requirements.lock"


ENTRY = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries() -> dict[str, tuple[str, list[str]]]:
    """name → (version, its sha256 hashes)."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in LOCK.read_text().splitlines():
        if match := ENTRY.match(line):
            current = canonical(match["name"])
            entries[current] = (match["version"], [])
        elif current and (digest := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            entries[current][1].append(digest[1])
    return entries


def locked_pins() -> dict[str, str]:
    return {name: version for name, (version, _) in lock_entries().items()}


SCRIPT = REPO_ROOT / "systemd" / "install.py"


def install(root: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # The real thing: the venv is built from deploy/requirements.lock with --require-hashes.
    result = subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--no-systemctl", *flags],
                            capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def snapshot(root: Path) -> dict[str, tuple[str, int, str]]:
    """Every path under root: kind, mode bits, and a content hash (or a link's target)."""
    tree = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                tree[str(path.relative_to(root))] = ("link", 0, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                tree[str(path.relative_to(root))] = ("dir", stat.S_IMODE(st.st_mode), "")
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                tree[str(path.relative_to(root))] = ("file", stat.S_IMODE(st.st_mode), digest)
    return tree


def copy_of(staged_root: Path, tmp_path: Path) -> Path:
    # The venv's absolute paths still point into the original root, so a copy re-runs without pip.
    root = tmp_path / "root"
    shutil.copytree(staged_root, root, symlinks=True)
    return root


def recipe(target: str, venv: Path, **variables: str) -> list[str]:
    """The commands `make <target>` would run (a dry run: nothing is executed)."""
    extra = [f"{key}={value}" for key, value in variables.items()]
    result = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}", *extra], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


PLAYBOOK = REPO_ROOT / "deploy" / "lora-worker.yml"
ANSIBLE = shutil.which("ansible-playbook") or str(Path(sys.executable).parent / "ansible-playbook")

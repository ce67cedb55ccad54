"""What a run was made of, read without running anything: the sd-scripts commit and the trainer venv's
package versions (from their metadata files, never by importing them)."""
from __future__ import annotations

import re
from pathlib import Path

TRAINER_PACKAGES = ("torch", "accelerate", "diffusers", "transformers", "bitsandbytes")
SHA = re.compile(r"^[0-9a-f]{40}$")


def trainer_versions(accelerate: Path) -> dict[str, str]:
    """Versions of the packages that shape a run, from `<venv>/lib/python3*/site-packages/*.dist-info`."""
    import importlib.metadata  # here, not above: the supervisor uses SHA only, and this is ~4 MiB and ~10 ms

    venv = accelerate.parent.parent
    site = [str(p) for p in sorted(venv.glob("lib/python3*/site-packages"))]
    found: dict[str, str] = {}
    if not site:
        return found
    for dist in importlib.metadata.distributions(path=site):
        name = _canonical(dist.name or "")
        if name in TRAINER_PACKAGES and name not in found:
            found[name] = dist.version
    return dict(sorted(found.items()))


def sd_scripts_commit(checkout: Path) -> str | None:
    """HEAD of the sd-scripts checkout, read from .git like `git rev-parse HEAD` would, or None."""
    git = checkout / ".git"
    try:
        if git.is_file():  # a worktree or submodule: "gitdir: <path>"
            git = (checkout / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
    except (OSError, IndexError):
        return None
    if SHA.match(head):
        return head
    if not head.startswith("ref: "):
        return None
    ref = head[5:]
    dirs = [git]
    try:  # a worktree keeps only its HEAD; branches live in the main repository's git dir
        dirs.append((git / (git / "commondir").read_text().strip()).resolve())
    except OSError:
        pass
    for directory in dirs:
        try:
            value = (directory / ref).read_text().strip()
            return value if SHA.match(value) else None
        except OSError:
            pass
        if (sha := _packed_ref(directory, ref)) is not None:
            return sha
    return None


def _packed_ref(directory: Path, ref: str) -> str | None:
    """The commit `ref` names in the git dir's packed-refs, or None."""
    try:
        for line in (directory / "packed-refs").read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name == ref and SHA.match(sha):
                return sha
    except OSError:
        pass
    return None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

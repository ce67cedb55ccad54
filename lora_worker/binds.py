"""Which host directories the trainer's sandbox may bind: never one that opens the sandbox up.

The sandbox binds a few directories the settings point at (the launcher's venv, sd-scripts, the tokenizers)
and the interpreter the launcher's `#!` line names. Each is derived from a path (`<venv>/bin/accelerate` →
`<venv>`), so a setting one level too close to `/` would bind `/` itself, or `/etc`, `/home`, the state dir:
read-only, but with the ledger, the token, other train ids and every host process's files in view. Such a
bind is refused (config load, doctor, dispatch and the supervisor all ask `too_wide`), never narrowed by
guess. A directory inside the state dir may be bound (the demo keeps its trainer there), not one of its own.

Anything under /usr is already in the sandbox, read-only, and is not bound again. Pure path logic, one
realpath, and the launcher's `#!` line and pyvenv.cfg read (`interpreter_dirs`): no import of the project, so
the settings can use it at load.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# `/` and the directories of the host's own system (FHS), and their usual second levels: binding any of them
# whole exposes far more than a trainer installation.
SYSTEM_DIRS = frozenset(Path(p) for p in (
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/lost+found",
    "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/var",
    "/var/lib", "/var/log", "/var/run", "/var/tmp", "/var/cache", "/var/spool", "/var/mail", "/var/opt"))
USR = Path("/usr")
# /lib, /bin, … are symlinks into /usr on merged-/usr distributions (Debian 12); real directories elsewhere.
USR_ALIASES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def already_present(path: Path) -> bool:
    """Under /usr: the sandbox has it read-only already, so it is never bound on its own."""
    return path == USR or USR in path.parents


def too_wide(path: Path, holds: Iterable[Path]) -> str | None:
    """Why binding `path` would open the sandbox up (a sentence), or None when it may be bound.

    `holds` are what the trainer must never see: the state dir and what the worker keeps in it (ledger, logs,
    locks), the train root (other train ids), the token file; `path` may not be one of them or hold one.
    Neither `path` nor what it resolves to may be `/` or a system directory."""
    holds = list(holds)
    for shown, candidate in _forms(path):
        if candidate in SYSTEM_DIRS:
            return f"{shown} is {'the root directory' if candidate == Path('/') else 'a system directory'}"
        for guarded in holds:
            if any(inside(form, candidate) for _, form in _forms(guarded)):
                return f"{shown} holds {guarded}"
    return None


def protected(settings: Any) -> list[Path]:
    """What of the worker's own a bind may never hold, from the settings."""
    found = [settings.state_dir, settings.database_path, settings.log_dir, settings.lock_dir, settings.slurm_logs,
             settings.gpu_locks, settings.train_root, settings.api_token_file]
    return [p for p in found if p is not None]


def inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def _forms(path: Path) -> list[tuple[str, Path]]:
    """The path as written (normalised) and as the kernel resolves it (bwrap follows links in a source)."""
    written = Path(os.path.normpath(os.path.abspath(path)))
    real = Path(os.path.realpath(written))
    forms = [(str(written), written)]
    if real != written:
        forms.append((f"{written} (which resolves to {real})", real))
    return forms


def interpreter_dirs(launcher: Path) -> tuple[Path, ...]:
    """The venv and installation prefix of the interpreter on the launcher's `#!` line, when outside /usr.

    A venv's python is a symlink to its base interpreter (`home` in pyvenv.cfg), whose standard library lives
    beside it; both must exist in the sandbox or the launcher cannot start."""
    try:
        with open(launcher, "rb") as fh:
            first = fh.readline(4096)
    except OSError:
        return ()
    if not first.startswith(b"#!"):
        return ()
    parts = first[2:].decode(errors="replace").split()
    if not parts:
        return ()
    interpreter = Path(parts[0])
    venv = interpreter.parent.parent
    cfg = venv / "pyvenv.cfg"
    found: list[Path] = [venv] if cfg.is_file() else []
    bin_dirs = [Path(os.path.realpath(interpreter)).parent]
    if found:
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                bin_dirs.append(Path(value.strip()))
    # Each bin directory's prefix; /bin, /sbin … are in the sandbox already (a link into /usr, or bound).
    aliases = {Path("/", name) for name in USR_ALIASES}
    found += [d.parent for d in bin_dirs if d not in aliases]
    return tuple(dict.fromkeys(found))  # `/` or a system directory among them: refused by bind_problem

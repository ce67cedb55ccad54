"""Path containment: every path the trainer receives is a resolved real path inside a directory we own.

`realpath(strict=True)` + `commonpath` is the check; string prefixes and unresolved `is_relative_to` both
accept `..` and symlink escapes. The resolved string is what goes into argv.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from lora_worker.errors import InvalidRequest, Unavailable

SAFE_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # matched whole (fullmatch)


def resolve_dir(raw: str, base: Path, field: str) -> Path:
    """An existing directory at or below `base`, as its real path."""
    real = _resolve_existing(raw, field)
    if not real.is_dir():
        raise InvalidRequest({field: ["Must be a directory."]})
    _require_inside(real, base, field)
    return real


def resolve_file(raw: str, bases: tuple[Path, ...], field: str, *, suffix: str) -> Path:
    """An existing regular file below one of `bases`, with the given suffix, as its real path."""
    real = _resolve_existing(raw, field)
    if not any(_inside(real, b) for b in _real_bases(bases)):
        allowed = ", ".join(str(b) for b in bases)
        raise InvalidRequest({field: [f"Must be inside an allowed directory ({allowed})."]})
    if not real.is_file():
        raise InvalidRequest({field: ["Must be a regular file."]})
    if real.suffix != suffix:
        raise InvalidRequest({field: [f"Must be a {suffix} file."]})
    return real


def resolve_new_dir(raw: str, base: Path, field: str) -> Path:
    """A directory at or below `base` that may not exist yet: its existing part resolved, the rest checked
    name by name. Nothing is created here; `create_output_dir` does that once the job is accepted."""
    path = Path(raw)
    missing: list[str] = []
    while not os.path.lexists(path):
        if path.name in ("", ".", ".."):
            raise InvalidRequest({field: ["Must be an absolute path without '.' or '..' components."]})
        missing.insert(0, path.name)
        path = path.parent
    real = _resolve_existing(str(path), field)
    for name in missing:
        if not SAFE_COMPONENT.fullmatch(name):
            raise InvalidRequest({field: [f"New directory name {name!r} is not allowed "
                                          "(letters, digits, '.', '_', '-'; not starting with '.' or '-')."]})
    if not real.is_dir():  # the path itself, or the existing part a new directory would be made under
        raise InvalidRequest({field: [f"Must be a directory; {real} is not one."]})
    resolved = real.joinpath(*missing)
    _require_inside(resolved, base, field)
    return resolved


def create_output_dir(path: Path) -> None:
    """Create the output directory group-writable; the setgid bit of the train root is inherited."""
    missing = []
    probe = path
    while not probe.exists():
        missing.insert(0, probe)
        probe = probe.parent
    for directory in missing:
        os.mkdir(directory)
        # mkdir applies the umask; the shared group (arbo) must be able to read and clean up outputs.
        inherited_setgid = directory.parent.stat().st_mode & 0o2000
        os.chmod(directory, 0o770 | inherited_setgid)


def real_train_root(root: Path) -> Path:
    try:
        return Path(os.path.realpath(root, strict=True))
    except OSError as exc:
        raise Unavailable(f"The train root {root} does not exist on this host.", missing=[str(root)]) from exc


def train_id_of(real: Path, root: Path) -> str:
    """The first component below the train root: `<root>/<train_id>/...`."""
    return real.relative_to(root).parts[0]


def require_same_train_dir(dataset: Path, output: Path, root: Path) -> None:
    """Both in one `<root>/<train_id>/`, and neither inside the other (sd-scripts would scan the output)."""
    if train_id_of(dataset, root) != train_id_of(output, root):
        raise InvalidRequest({"output_dir": [
            f"Must be in the same {root}/<train_id>/ directory as dataset_dir."]})
    if _inside(output, dataset) or _inside(dataset, output):
        raise InvalidRequest({"output_dir": ["Must not be inside dataset_dir, nor contain it."]})


def _resolve_existing(raw: str, field: str) -> Path:
    if "\x00" in raw:
        raise InvalidRequest({field: ["Must not contain NUL bytes."]})
    if not os.path.isabs(raw):
        raise InvalidRequest({field: ["Must be an absolute path."]})
    try:
        return Path(os.path.realpath(raw, strict=True))
    except FileNotFoundError as exc:
        raise InvalidRequest({field: ["Does not exist."]}) from exc
    except OSError as exc:
        raise InvalidRequest({field: [f"Cannot be resolved ({exc.strerror or exc})."]}) from exc


def _require_inside(real: Path, base: Path, field: str) -> None:
    if not _inside(real, base) or real == base:
        raise InvalidRequest({field: [f"Must be inside {base}/<train_id>/."]})


def _inside(real: Path, base: Path) -> bool:
    return os.path.commonpath([str(base), str(real)]) == str(base)


def _real_bases(bases: tuple[Path, ...]) -> list[Path]:
    return [Path(os.path.realpath(b)) for b in bases if os.path.isdir(b)]

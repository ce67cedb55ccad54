"""Path containment: every path the trainer receives is a resolved real path inside a directory we own.

`realpath(strict=True)` + `commonpath` is the check; string prefixes and unresolved `is_relative_to` both
accept `..` and symlink escapes. The resolved string is what goes into argv and into the job's row. A
relative `dataset_dir` or `output_dir` (Studio's names, `t1/dataset`) is taken under the train root, with the
same rules. A path the OS would refuse as too long is the request's problem (422), found before it is used.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from lora_worker.errors import InvalidRequest, OutputExists, TrainRootMissing
from lora_worker.host import fs

SAFE_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # matched whole (fullmatch)


def resolve_dir(raw: str, base: Path, field: str) -> Path:
    """An existing directory at or below `base` (a relative name is taken under it), as its real path."""
    real = _resolve_existing(under(raw, base, field), field)
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
    absolute = under(raw, base, field)
    if problem := fs.check_length(absolute):  # else lexists() below says False, and the walk goes wrong
        raise InvalidRequest({field: [f"The path {problem}."]})
    path = Path(absolute)
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
    if problem := fs.check_length(str(resolved)):  # the real path can be longer than the name given
        raise InvalidRequest({field: [f"The resolved path {problem}."]})
    return resolved


def under(raw: str, base: Path, field: str) -> str:
    """`raw` as an absolute path: a relative name means `<base>/<name>`, and may not climb out of it."""
    if "\x00" in raw:
        raise InvalidRequest({field: ["Must not contain NUL bytes."]})
    if not raw:
        raise InvalidRequest({field: ["Must not be empty."]})
    if not os.path.isabs(raw):
        if any(part in (".", "..") for part in raw.split("/")):
            raise InvalidRequest({field: [f"A relative name is taken under {base}; it must not contain "
                                          "'.' or '..' components."]})
        raw = os.path.join(str(base), raw)
    return raw


def without_dot_components(path: str) -> str:
    """`./t1/dataset` → `t1/dataset`, `/train/./t1/` → `/train/t1`: the same path, as the OS would read it."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    return ("/" if path.startswith("/") else "") + "/".join(parts)


def require_no_output(lora_file: str) -> None:
    """Nothing at all may be at the LoRA's path: a file, a directory, a FIFO, or a symlink (dangling or not,
    which the trainer would write through to wherever it points). The output directory is walked without
    following links; if it does not exist yet, neither does anything in it."""
    if problem := fs.check_length(lora_file):
        raise InvalidRequest({"output_dir": [f"{lora_file} {problem}."]})
    directory, name = os.path.split(lora_file)
    try:
        dir_fd = fs.open_dir(directory)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise InvalidRequest({"output_dir": [f"Cannot be opened without following links ({exc})."]}) from exc
    try:
        found = fs.entry_at(dir_fd, name)
    finally:
        os.close(dir_fd)
    if found is not None:
        raise OutputExists(f"{lora_file} already exists (a {fs.kind_of(found.st_mode)}); "
                           "choose another output_name.", path=lora_file, kind=fs.kind_of(found.st_mode))


def create_output_dir(path: Path) -> fs.FileId:
    """Create the output directory group-writable (the setgid bit of the train root is inherited), without
    following a link on the way; returns its identity, which the supervisor checks again before exec."""
    return fs.make_dirs(str(path), 0o770)


def real_train_root(root: Path) -> Path:
    try:
        return Path(os.path.realpath(root, strict=True))
    except OSError as exc:
        raise TrainRootMissing(f"The train root {root} does not exist on this host.", missing=[str(root)]) from exc


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
    if problem := fs.check_length(raw):
        raise InvalidRequest({field: [f"The path {problem}."]})
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

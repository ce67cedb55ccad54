"""The installer's byte-code step: which modules of the installed code and its venv lack current byte code.

The unit's ProtectSystem=strict makes the prefix read-only, so a module without a current `.pyc` there is
compiled from source again at every start of every process that imports it (each job's supervisor among them,
on the path from POST /train to the trainer's execve), and the result is thrown away. pip compiles what it
installs into site-packages, but not an editable install's source: the worker itself. So the installer compiles
both with the venv's own interpreter, at the optimisation level the unit runs it with (none: no -O, no
PYTHONOPTIMIZE), and asks here, the way the import system does, what is still stale.

Standard library only, like install.py.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

PYC_HEADER = 16  # magic, flags, source mtime, source size (PEP 552)


def sources(directories: list[Path]) -> Iterator[Path]:
    for top in directories:
        for directory, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            yield from (Path(directory) / name for name in sorted(files) if name.endswith(".py"))


def is_stale(source: Path) -> bool:
    """Whether importing `source` would compile it: its `.pyc` is missing, from another Python, or records
    another mtime or size of the source than the one on disk (what the import system compares)."""
    try:
        with open(importlib.util.cache_from_source(str(source)), "rb") as fh:
            header = fh.read(PYC_HEADER)
    except OSError:
        return True
    if len(header) < PYC_HEADER or header[:4] != importlib.util.MAGIC_NUMBER:
        return True
    if int.from_bytes(header[4:8], "little") & 0b1:
        return False  # hash-based: checked against the source by its hash, never recompiled on an mtime
    st = source.stat()
    return (int.from_bytes(header[8:12], "little") != int(st.st_mtime) & 0xFFFFFFFF
            or int.from_bytes(header[12:16], "little") != st.st_size & 0xFFFFFFFF)


def stale(directories: list[Path]) -> list[Path]:
    return [path for path in sources(directories) if is_stale(path)]


def compile_all(python: Path, directories: list[Path]) -> str | None:
    """Compile what is stale under `directories` with `python`; None, or what went wrong."""
    result = subprocess.run([str(python), "-m", "compileall", "-q", "-j", "0", *map(str, directories)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return (result.stdout + result.stderr).strip()[-2000:] or f"compileall exited {result.returncode}"
    return None

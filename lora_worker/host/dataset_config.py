"""The dataset config a job's argv names (`--dataset_config=`, dispatch/presentation.py writes it), as the process
that starts the trainer checks it right before exec: on this host (run/prelaunch.py) or on a Slurm node.

The file lies in the worker's own directory (the state dir, or the Slurm log dir), named by the sha256 of its
bytes, so what is checked is simply that the bytes are still those: opened without following a link, read
capped, hashed. The descriptor stays open and is what the sandbox binds (host/sandbox.py), so nothing swapped in
after this look is what the trainer reads.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

from lora_worker.host import fs

CONFIG_FLAG = "--dataset_config="
CONFIG_MAX_BYTES = 64 * 1024
SUFFIX = ".toml"  # sd-scripts reads a TOML config by its name's suffix (config_util.py load_user_config)


def config_path_of(argv: Iterable[str]) -> str | None:
    """The `--dataset_config=` path of a job's argv; None for a row presented by `--train_data_dir`."""
    return next((a[len(CONFIG_FLAG):] for a in argv if a.startswith(CONFIG_FLAG)), None)


def name_for(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest() + SUFFIX


def open_checked(path: str) -> tuple[int | None, str | None]:
    """(the file held open, None), or (None, why it must not be used): it cannot be opened as a regular file
    without following a link, or its bytes are not the ones its name is the sha256 of."""
    try:
        fd = fs.open_in(os.path.dirname(path), os.path.basename(path))
    except OSError as exc:
        return None, f"the dataset config {path} cannot be opened ({exc.strerror or exc})"
    try:
        data = fs.read_capped(fd, CONFIG_MAX_BYTES)
    except OSError as exc:
        os.close(fd)
        return None, f"the dataset config {path} cannot be read ({exc.strerror or exc})"
    if name_for(data) != os.path.basename(path):
        os.close(fd)
        return None, f"the dataset config {path} is not the file dispatch wrote (its sha256 is not its name)"
    return fd, None

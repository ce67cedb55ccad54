"""Free space on the output volume, so a run never trains for an hour and then fails to save."""
from __future__ import annotations

import shutil
from pathlib import Path

from lora_worker.errors import InsufficientDisk


def require_free_space(path: Path, need_mib: int) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    free_mib = shutil.disk_usage(probe).free // (1024 * 1024)
    if free_mib < need_mib:
        raise InsufficientDisk(
            f"The output volume has {free_mib} MiB free; this tier needs {need_mib} MiB.",
            free_mib=free_mib, need_mib=need_mib, path=str(probe))

"""How a job's dataset is presented to sd-scripts: so that ONE epoch covers every step asked (issue 32).

sd-scripts 48d368fa resumed with `--skip_until_initial_step` numbers the steps of a state past its first epoch
from that epoch's start (train_network.py L1340-1344; docs/reference/sd-scripts-resume.md §4): the run then trains
more steps than asked and names its files wrongly. A state inside the first epoch resumes right. So the worker
shows sd-scripts the request's kohya folder with the smallest repeat count for which one epoch holds at least the
steps asked (images × repeats / batch ≥ max_train_steps), and every state the run saves lies in its first epoch.

It does so without touching arbo's folders and without a flag of the client's: a `--dataset_config` TOML written
by the worker (`DatasetConfig`), in a directory of its own the trainer's host reads (the backend's `files_dir`:
this host's state dir, or the Slurm log dir a node shares), named by its own sha256, so the argv (and with it
the job's fingerprint) names the presentation exactly. It holds one DreamBooth subset: the kohya folder, its
class tokens (`<trigger> <subject_class>`, what sd-scripts took from the folder's name) and `num_repeats`;
everything else falls back to the argv's flags as it did with `--train_data_dir` (config_util.py
`generate_params_by_fallbacks`: batch size, resolution, buckets, caption extension).

`Presentation` is the one computation of what sd-scripts will make of a dataset: the repeats it sees, the steps
of an epoch, the epochs, and the states the run saves and whether each could be resumed. `as_folder` is the rule
of the rows accepted before (the folder's own repeats, `--train_data_dir`), which their resumes keep.
"""
from __future__ import annotations

import hashlib
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lora_worker.errors import DatasetInvalid, LaunchFailed
from lora_worker.host import fs
from lora_worker.host.dataset_config import (CONFIG_FLAG, SUFFIX, Unwritable, class_tokens, config_path_of,
                                             one_epoch_repeats, render)

__all__ = ["CONFIG_FLAG", "DATASETS", "DatasetConfig", "Presentation", "SavedState", "as_folder", "class_tokens",
           "config_for", "config_path_of", "dataset_config_toml", "one_epoch", "write"]

if TYPE_CHECKING:
    from lora_worker.backends import Backend
    from lora_worker.config import Settings
    from lora_worker.dispatch.request import ResolvedRequest

DATASETS = "datasets"  # under the backend's files_dir


@dataclass(frozen=True)
class SavedState:
    step: int
    resumable: bool  # inside the first epoch, and not the last step


@dataclass(frozen=True)
class Presentation:
    """What sd-scripts makes of `images` images shown `repeats` times, at `batch` per step, for `steps` optimizer
    steps with a state every `every` steps."""

    images: int
    batch: int
    steps: int
    every: int
    repeats: int

    @property
    def steps_per_epoch(self) -> int:
        """A lower bound of sd-scripts' batches per epoch: each bucket's batches are rounded up, so an epoch has at
        least ceil(images × repeats / batch); with one bucket exactly that."""
        return math.ceil(self.images * self.repeats / self.batch)

    @property
    def epochs(self) -> int:
        """At most this many epochs (sd-scripts: ceil(max_train_steps / batches per epoch))."""
        return math.ceil(self.steps / self.steps_per_epoch)

    @property
    def states(self) -> tuple[SavedState, ...]:
        """Each step sd-scripts saves a state at, and whether a resume from it would train right: it lies inside
        the first epoch (`state_past_first_epoch` otherwise) and is not the last step (nothing left to train)."""
        return tuple(SavedState(s, s < self.steps_per_epoch and s < self.steps)
                     for s in range(self.every, self.steps + 1, self.every))


def one_epoch(images: int, batch: int, steps: int, every: int) -> Presentation:
    """The worker's presentation: the smallest repeats with images × repeats / batch ≥ steps (one epoch)."""
    if images < 1 or batch < 1 or steps < 1 or every < 1:
        raise ValueError(f"no presentation of {images} images at batch {batch} for {steps} steps every {every}")
    return Presentation(images, batch, steps, every, one_epoch_repeats(images, batch, steps))


def as_folder(images: int, repeats: int, batch: int, steps: int, every: int) -> Presentation:
    """The rule before issue 32: sd-scripts saw the folder's own repeats (`--train_data_dir`)."""
    return Presentation(images, batch, steps, every, repeats)


# -- the dataset config -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DatasetConfig:
    path: Path  # <files_dir>/datasets/<sha256 of content>.toml: what `--dataset_config=` names
    content: bytes
    presentation: Presentation


def dataset_config_toml(image_dir: str, tokens: str, repeats: int) -> bytes:
    """The file's bytes (host/dataset_config.py `render`); DatasetInvalid (422) for a value it cannot carry."""
    try:
        return render(image_dir, tokens, repeats)
    except Unwritable as exc:
        raise DatasetInvalid({"dataset_dir": [str(exc)]}) from exc


def config_for(req: ResolvedRequest, settings: Settings, backend: Backend, images: int) -> DatasetConfig:
    """The dataset config of a request of `images` images on `backend` (its batch size, its files_dir)."""
    batch = backend.profile(settings, req.tier.name, req.device_index).train_batch_size
    shown = one_epoch(images, batch, req.expected.steps, settings.save_every_n_steps(req.tier.name))
    content = dataset_config_toml(os.path.join(req.dataset_dir, req.kohya_folder),
                                  class_tokens(req.trigger, req.subject_class), shown.repeats)
    name = hashlib.sha256(content).hexdigest() + SUFFIX
    return DatasetConfig(backend.files_dir(settings) / DATASETS / name, content, shown)


def write(config: DatasetConfig) -> None:
    """Put the file in place at every launch (the same bytes again, for a resume: its mtime says when a launch last
    named it, which retention goes by); LaunchFailed when it cannot be. Written beside, then renamed: a reader sees
    the whole file or the one before, never a part."""
    directory = config.path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)  # the worker's own state dir (or Slurm log dir)
        tmp = f".{config.path.name}.{secrets.token_hex(8)}.tmp"  # two dispatches of one request may write at once
        fd = fs.open_in(directory, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            os.write(fd, config.content)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(directory / tmp, config.path)
    except OSError as exc:
        raise LaunchFailed(f"Cannot write the dataset config {config.path}: {exc.strerror or exc}.") from exc

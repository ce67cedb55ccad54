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

`presentation` is THE one computation of what sd-scripts will make of a dataset (the one function to change when
the way the dataset is handed to it changes): the repeats it sees, images × repeats, the steps of an epoch (by the
buckets when they are known), the epochs, and the states the run saves and whether each could be resumed. The dry
run (dispatch/plan.py), the dataset config a launch writes (`config_for`) and the resume check (resumable.py) all
ask it. A row accepted before issue 32 (`--train_data_dir`) was shown the kohya folder's own repeats
(`folder_repeats`), which its resumes keep.
"""
from __future__ import annotations

import hashlib
import math
import os
import secrets
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lora_worker.errors import DatasetInvalid, LaunchFailed
from lora_worker.host import fs
from lora_worker.host.dataset_config import (CONFIG_FLAG, SUFFIX, Unwritable, class_tokens, config_path_of,
                                             one_epoch_repeats, render)

__all__ = ["CONFIG_FLAG", "DATASETS", "DatasetConfig", "Presentation", "SavedState", "class_tokens", "config_for",
           "config_path_of", "dataset_config_toml", "presentation", "write"]

if TYPE_CHECKING:
    from lora_worker.backends import Backend
    from lora_worker.config import Settings
    from lora_worker.dispatch.buckets import Bucket
    from lora_worker.dispatch.request import ResolvedRequest

DATASETS = "datasets"  # under the backend's files_dir


@dataclass(frozen=True)
class SavedState:
    step: int
    resumable: bool  # inside the first epoch, and not the last step


@dataclass(frozen=True)
class Presentation:
    """The dataset as sd-scripts is shown it: `images` images `repeats` times, at `batch_size` per step, for
    `max_train_steps` optimizer steps with a state every `save_every`; and, when the images' buckets are known, how
    many fall in each (without repeats)."""

    images: int
    repeats: int  # the repeats sd-scripts sees (`num_repeats`)
    batch_size: int
    max_train_steps: int
    save_every: int
    bucket_sizes: tuple[int, ...] | None = None

    @property
    def images_x_repeats(self) -> int:
        return self.images * self.repeats

    @property
    def first_epoch_steps_at_least(self) -> int:
        """A lower bound of the batches of an epoch without the buckets: each bucket's are rounded up, so an epoch
        has at least ceil(images × repeats / batch size) of them (with one bucket, exactly that)."""
        return math.ceil(self.images_x_repeats / self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        """sd-scripts' `num batches per epoch`: each bucket's images × repeats in batches, rounded up
        (train_util.py L1076-1082); the lower bound when the buckets are not known."""
        if self.bucket_sizes is None:
            return self.first_epoch_steps_at_least
        return sum(math.ceil(n * self.repeats / self.batch_size) for n in self.bucket_sizes)

    @property
    def epochs(self) -> int:
        """`num epochs`: ceil(max_train_steps / batches per epoch) (train_network.py L978-979)."""
        return math.ceil(self.max_train_steps / self.steps_per_epoch) if self.steps_per_epoch else 0

    def state_resumable(self, step: int) -> bool:
        """Whether a state saved at `step` can be resumed from (resumable.py's numbering rules): inside the first
        epoch by the lower bound the resume check has (it knows no buckets), and not the last step."""
        return step < self.first_epoch_steps_at_least and step < self.max_train_steps

    @property
    def states(self) -> tuple[SavedState, ...]:
        """Each step sd-scripts saves a state at (`--save_every_n_steps`), and whether a resume could start from it
        (`state_past_first_epoch` and `state_at_last_step` otherwise)."""
        steps = range(self.save_every, self.max_train_steps + 1, self.save_every) if self.save_every > 0 else ()
        return tuple(SavedState(s, self.state_resumable(s)) for s in steps)


def presentation(images: int, batch_size: int, max_train_steps: int, save_every: int,
                 buckets: list[Bucket] | None = None, *, folder_repeats: int | None = None) -> Presentation:
    """How sd-scripts is shown `images` images at `batch_size` for `max_train_steps` steps, a state every
    `save_every`: with the smallest repeats for which images × repeats / batch size ≥ max_train_steps, so one epoch
    covers the run (every job since issue 32); with `folder_repeats`, the kohya folder's own repeats
    (`--train_data_dir`: a row accepted before, whose resume keeps its argv). `buckets`: each image's, when known."""
    if images < 1 or batch_size < 1 or max_train_steps < 1:
        raise ValueError(f"no presentation of {images} images at batch {batch_size} for {max_train_steps} steps")
    repeats = folder_repeats if folder_repeats is not None else one_epoch_repeats(images, batch_size, max_train_steps)
    sizes = None
    if buckets is not None:
        counts = Counter(bucket.resolution for bucket in buckets)
        sizes = tuple(counts[reso] for reso in sorted(counts))
    return Presentation(images, repeats, batch_size, max_train_steps, save_every, sizes)


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


def config_for(req: ResolvedRequest, settings: Settings, backend: Backend, images: int,
               buckets: list[Bucket] | None = None) -> DatasetConfig:
    """The dataset config of a request of `images` images on `backend` (its batch size, its files_dir), and the
    presentation it makes (with the images' `buckets` when known: a dry run's plan)."""
    batch = backend.profile(settings, req.tier.name, req.device_index).train_batch_size
    shown = presentation(images, batch, req.expected.steps, settings.save_every_n_steps(req.tier.name), buckets)
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

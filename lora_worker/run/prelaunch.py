"""The last look before exec: what the trainer is about to be given is still what dispatch checked.

Between the 202 and the exec, the train root stays writable by arbo and its users. So right before the
supervisor starts the trainer, it walks every directory again without following a link and compares its
(device, inode) with the one recorded at acceptance: a directory swapped for a symlink, or for another
directory, stops the job (`failed`, `launch_error`) before the trainer has opened anything. It also looks
again at what the trainer will open inside them (no new subset folder, no image or caption turned into a
link or a FIFO) and at the LoRA's path, where nothing may be yet: the file found there after the run is
then the trainer's, which is how the artifact check knows it is fresh without comparing clocks. The dataset config
the argv names (dispatch/presentation.py) must hold exactly what the row makes of it: this job's kohya folder, class
tokens and one epoch's repeats.

The directories stay open from this look to the trainer's start: the sandbox mounts those descriptors, not
the paths again (`check`; `what_moved` is the look alone).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from lora_worker.host import fs, kohya
from lora_worker.host.dataset_config import class_tokens, config_path_of, expected, open_checked
from lora_worker.host.images import SAMPLE_DIR
from lora_worker.ledger.supervisor import JobRecord


@dataclass
class Checked:
    """The outcome of the last look: why the trainer must not start (None: it may), and the directories as
    they were checked, open, by the path they were reached at. The sandbox binds these very descriptors
    (host/sandbox.py), so nothing renamed or linked after the check is what gets mounted."""

    moved: str | None
    held: dict[Path, int] = field(default_factory=dict)

    def close(self) -> None:
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()


def what_moved(job: JobRecord) -> str | None:
    """Why the trainer must not start (a sentence), or None when everything is as it was checked."""
    checked = check(job)
    checked.close()
    return checked.moved


def check(job: JobRecord) -> Checked:
    """The last look; the caller closes what it holds (at once when `moved`, else once bwrap has started)."""
    folder = kohya.folder_name(job.repeats, job.trigger, job.subject_class)
    directories = (("dataset_dir", job.dataset_dir, job.dataset_dev_ino),
                   ("the kohya folder", os.path.join(job.dataset_dir, folder), job.kohya_dev_ino),
                   ("output_dir", job.output_dir, job.output_dev_ino))
    fds: dict[str, int] = {}
    checked = Checked(None)
    try:
        for label, path, recorded in directories:
            try:
                fds[label] = fs.open_dir(path)
            except OSError as exc:
                checked.moved = f"{label} {path} cannot be opened without following links ({exc})"
                return checked
            checked.held[Path(path)] = fds[label]
            now = fs.FileId.of(os.fstat(fds[label]))
            if recorded is not None and now != fs.FileId.parse(recorded):
                checked.moved = f"{label} {path} is not the directory that was checked (was {recorded}, now {now})"
                return checked
        try:
            checked.moved = (_new_subset(fds["dataset_dir"], folder)
                             or _unsafe_entry(fds["the kohya folder"], folder)
                             or _output_moved(fds["output_dir"], os.path.basename(job.lora_file)))
        except OSError as exc:  # made unreadable meanwhile: as good as moved
            checked.moved = f"the dataset or output_dir can no longer be listed ({exc.strerror or exc})"
        if checked.moved is None:
            checked.moved = _hold_config(job, folder, checked.held)
        return checked
    except BaseException:
        checked.close()
        raise
    finally:
        if checked.moved is not None:
            checked.close()


def _hold_config(job: JobRecord, folder: str, held: dict[Path, int]) -> str | None:
    """The dataset config the argv names, held with the directories (the sandbox binds it), or why not."""
    config = config_path_of(job.argv)
    if config is None:
        return None  # a row given --train_data_dir
    want = expected(job.argv, os.path.join(job.dataset_dir, folder), class_tokens(job.trigger, job.subject_class),
                    job.image_count, job.total_steps)
    fd, problem = open_checked(config, want)
    if fd is not None:
        held[Path(config)] = fd
    return problem


def _new_subset(dataset_fd: int, folder: str) -> str | None:
    for name, st in fs.list_entries(dataset_fd):
        if name != folder and kohya.subset_repeats(name) is not None and (
                stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return f"dataset_dir now holds {name!r} ({fs.kind_of(st.st_mode)}), which sd-scripts would train on"
    return None


def _unsafe_entry(folder_fd: int, folder: str) -> str | None:
    entries = dict(fs.list_entries(folder_fd))
    opened = [n for n in entries if kohya.is_trained_image(n)]
    opened += [c for image in list(opened) for c in kohya.caption_candidates(image) if c in entries]
    for name in opened:
        if not stat.S_ISREG(entries[name].st_mode):
            return f"{folder}/{name} is now a {fs.kind_of(entries[name].st_mode)}, not a regular file"
    return None


def _output_moved(output_fd: int, lora_name: str) -> str | None:
    """What the trainer will write into output_dir is not there in its way: no LoRA yet, no link at `sample`."""
    return _lora_present(output_fd, lora_name) or _sample_folder(output_fd)


def _sample_folder(output_fd: int) -> str | None:
    """`sample`, where sd-scripts writes its sample images, is absent or a real directory: a link there would take
    them elsewhere (the follower never follows one: transcript/samples.py)."""
    found = fs.entry_at(output_fd, SAMPLE_DIR)
    if found is not None and not stat.S_ISDIR(found.st_mode):
        return f"output_dir's {SAMPLE_DIR!r} is a {fs.kind_of(found.st_mode)}, not the folder of the sample images"
    return None


def _lora_present(output_fd: int, name: str) -> str | None:
    """`name` is the recorded LoRA file's (dispatch built its path once; it lies in output_dir)."""
    found = fs.entry_at(output_fd, name)
    if found is not None:
        return f"{name} appeared in output_dir after the job was accepted (a {fs.kind_of(found.st_mode)})"
    return None

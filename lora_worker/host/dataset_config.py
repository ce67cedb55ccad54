"""The dataset config a job's argv names (`--dataset_config=`): the TOML file sd-scripts reads the job's dataset
through (dispatch/presentation.py decides what it holds and writes it), and the look at it right before exec, by
the process that starts the trainer: on this host (run/prelaunch.py) or on a Slurm node.

The file is one DreamBooth subset in literal strings only: sd-scripts reads it with the `toml` package 0.10.2
(config_util.py `load_user_config`), whose basic strings mis-read escapes (on the rig, `\\"\\"\\"}` came back
empty and `\\u001F…\\\\u` was refused: tests/rig/test_real_presentation.py). A literal string has no escapes: its
text is read back as written, by that parser and by tomllib, whatever it holds except `'`, a control character
other than tab, or what UTF-8 cannot encode; such a value is refused (`Unwritable`), never escaped.

Right before exec, the file must be a regular file (no link followed, nothing that blocks), hold at most
CONFIG_MAX_BYTES, and be exactly what `render` makes of the job's own row (its kohya folder, its class tokens, and
the repeats one epoch of its steps takes, `one_epoch_repeats`): what the trainer reads is this job's dataset. The
descriptor stays open and is what the sandbox binds (host/sandbox.py), so nothing swapped in after this look is
what the trainer reads. (Its name is the sha256 of its bytes, which dispatch and a resume's fingerprint compare;
the supervisor compares the bytes and hashes nothing: OpenSSL is loaded only at the end of a run.)
"""
from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterable

from lora_worker.host import fs

CONFIG_FLAG = "--dataset_config="
CONFIG_MAX_BYTES = 64 * 1024
SUFFIX = ".toml"  # sd-scripts reads a TOML config by its name's suffix (config_util.py load_user_config)
BATCH_FLAG = "--train_batch_size="


class Unwritable(ValueError):
    """A value no TOML literal string can carry exactly."""


def one_epoch_repeats(images: int, batch: int, steps: int) -> int:
    """The smallest repeats with images × repeats / batch ≥ steps: one epoch holds every step (the rule of
    dispatch/presentation.py `presentation`, where it is explained)."""
    return -(-steps * batch // images)


def class_tokens(trigger: str, subject_class: str) -> str:
    """What sd-scripts took from the folder `<repeats>_<trigger> <subject_class>` (everything after the first `_`,
    config_util.py `extract_dreambooth_params`): the caption of an image without a caption file."""
    return f"{trigger} {subject_class}"


def literal(value: str, what: str) -> str:
    """`value` as a TOML literal string; Unwritable (saying what and why) when it cannot be one exactly."""
    bad = next((ch for ch in value if ch == "'" or (ch != "\t" and unicodedata.category(ch) in ("Cc", "Cs"))), None)
    if bad is not None:
        raise Unwritable(f"{what} holds {bad!r}, which sd-scripts' dataset config (a TOML literal string, read by the "
                         "toml 0.10.2 parser that mis-reads escapes) cannot carry exactly: rename it without quotes or "
                         "control characters")
    return f"'{value}'"


def render(image_dir: str, class_tokens: str, repeats: int) -> bytes:
    """The whole file: one dataset of one DreamBooth subset; every other value falls back to the argv's flags."""
    lines = ["[[datasets]]", "", "[[datasets.subsets]]",
             f"image_dir = {literal(image_dir, 'The kohya folder ' + repr(image_dir))}",
             f"class_tokens = {literal(class_tokens, 'The class tokens ' + repr(class_tokens))}",
             f"num_repeats = {int(repeats)}", ""]
    return "\n".join(lines).encode("utf-8")


def config_path_of(argv: Iterable[str]) -> str | None:
    """The `--dataset_config=` path of a job's argv; None for a row presented by `--train_data_dir`."""
    return next((a[len(CONFIG_FLAG):] for a in argv if a.startswith(CONFIG_FLAG)), None)


def expected(argv: list[str], image_dir: str, tokens: str, images: int | None, steps: int) -> bytes | None:
    """The bytes the config of a job's row must hold (None when the row cannot say: no image count or batch)."""
    batch = next((a[len(BATCH_FLAG):] for a in argv if a.startswith(BATCH_FLAG)), "")
    if not images or not batch.isdigit() or int(batch) < 1:
        return None
    return render(image_dir, tokens, one_epoch_repeats(images, int(batch), steps))


def open_checked(path: str, want: bytes | None) -> tuple[int | None, str | None]:
    """(the file held open, None), or (None, why it must not be used): it cannot be opened as a regular file
    without following a link, or it does not hold `want` (the row's config: `expected`)."""
    try:
        fd = fs.open_in(os.path.dirname(path), os.path.basename(path))
    except OSError as exc:
        return None, f"the dataset config {path} cannot be opened ({exc.strerror or exc})"
    try:
        if fs.read_capped(fd, CONFIG_MAX_BYTES) != want:
            raise fs.Refused(0, "it is not the config of this job's kohya folder, class tokens and steps")
    except OSError as exc:
        os.close(fd)
        return None, f"the dataset config {path} cannot be used ({exc.strerror or exc})"
    return fd, None

"""A job's sample prompts (issue 33, docs/samples.md): the request's, or one made from its trigger and class; the
prompts file sd-scripts reads (`--sample_prompts`); and the flags that draw them.

The file is JSON, a list of dicts sd-scripts uses as they are (train_util.py L6420-6447): no prompt text is ever
parsed for ` --` options, as a `.txt` line would be. It holds each prompt, its seed, the tier's resolution and the
audited sampler steps, CFG scale and negative prompt (config_tables.SAMPLE_*); never a sampler name (the flag
names it, and argparse checks it). It lies in the worker's own storage, never in arbo's folders: under the
directory the job's backend shares with its trainer (`Backend.files_dir`: this host's state dir, or the storage
a Slurm node reads the job's spec from), named by the sha256 of its bytes, so the same prompts are one file, a
resume of the job finds its original's, and the command the fingerprint rebuilds names the same path. The sandbox
binds it read-only (host/sandbox.py `argv_files`).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_worker.config import Settings, Tier
from lora_worker.errors import LaunchFailed
from lora_worker.config_tables import (SAMPLE_NEGATIVE_PROMPT, SAMPLE_SAMPLER, SAMPLE_SCALE, SAMPLE_SEED,
                                       SAMPLED_STEP_LORAS_KEPT, STEP_LORAS_KEPT)

if TYPE_CHECKING:
    from lora_worker.backends import Backend

PROMPTS_DIR = "prompts"
SAMPLE_FLAGS = ("--sample_at_first",)  # the switch a job with samples adds after SCRIPT_FLAGS (never a resume)


@dataclass(frozen=True)
class SamplePrompt:
    prompt: str
    seed: int


def resolve_samples(requested: Iterable[Mapping[str, Any]] | None, trigger: str,
                    subject_class: str) -> tuple[SamplePrompt, ...]:
    """The job's prompts: the request's, each with its seed or SAMPLE_SEED + its index; None (left out): one of
    the trigger and the class; () (an empty list): none, and no sample pass."""
    if requested is None:
        return (SamplePrompt(f"photo of {trigger} {subject_class.replace('_', ' ')}", SAMPLE_SEED),)
    return tuple(SamplePrompt(str(p["prompt"]), int(p["seed"]) if p.get("seed") is not None else SAMPLE_SEED + i)
                 for i, p in enumerate(requested))


def as_rows(samples: Iterable[SamplePrompt]) -> list[dict[str, Any]]:
    """The prompts as the job's row records them (`sample_prompts`)."""
    return [{"prompt": s.prompt, "seed": s.seed} for s in samples]


def prompts_document(samples: Iterable[SamplePrompt], tier: Tier, sample_steps: int) -> bytes:
    """The prompts file's bytes: the same prompts at the same size always give the same bytes."""
    entries = [{"prompt": s.prompt, "negative_prompt": SAMPLE_NEGATIVE_PROMPT, "width": tier.resolution,
                "height": tier.resolution, "seed": s.seed, "sample_steps": sample_steps, "scale": SAMPLE_SCALE}
               for s in samples]
    return json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class PromptsFile:
    path: Path
    data: bytes


def prompts_file(samples: tuple[SamplePrompt, ...], tier: Tier, settings: Settings,
                 backend: Backend) -> PromptsFile | None:
    """Where the job's prompts file lies and what it holds; None for a job without samples."""
    if not samples:
        return None
    data = prompts_document(samples, tier, settings.sample_steps(tier.name))
    name = f"{hashlib.sha256(data).hexdigest()[:32]}.json"
    return PromptsFile(backend.files_dir(settings) / PROMPTS_DIR / name, data)


def sample_args(found: PromptsFile | None, every: int) -> dict[str, str | None]:
    """The `--key=value` pairs of the sample flags (`--sample_at_first` is a switch: `sample_switches`)."""
    if found is None:
        return {"sample_prompts": None, "sample_every_n_steps": None, "sample_sampler": None}
    return {"sample_prompts": str(found.path), "sample_every_n_steps": str(every), "sample_sampler": SAMPLE_SAMPLER}


def sample_switches(found: PromptsFile | None) -> tuple[str, ...]:
    """`--sample_at_first`: the base model's look, before the first step (never on a resume: refingerprint.py)."""
    return SAMPLE_FLAGS if found is not None else ()


def step_loras_kept(samples: tuple[SamplePrompt, ...], total_steps: int, every: int) -> int:
    """How many step LoRAs the trainer keeps: every sampled one, up to SAMPLED_STEP_LORAS_KEPT, or one without
    samples."""
    if not samples:
        return STEP_LORAS_KEPT
    return max(1, min(SAMPLED_STEP_LORAS_KEPT, total_steps // every))


def disk_counts(samples: tuple[SamplePrompt, ...], total_steps: int, every: int) -> dict[str, int]:
    """What a job keeps on the output volume beyond the tier's LoRA (dispatch/disk.py): its step LoRAs and its
    sample images (a pass before the first step and one at each save)."""
    passes = total_steps // every + 1 if samples else 0
    return {"step_loras": step_loras_kept(samples, total_steps, every), "images": passes * len(samples)}


def write_prompts(found: PromptsFile | None) -> None:
    """Make sure the prompts file holds its bytes (written whole under a temporary name, then renamed; a file
    there already is rewritten only if it differs)."""
    if found is None:
        return
    try:
        _write(found)
    except OSError as exc:
        raise LaunchFailed(f"Cannot write the sample prompts file {found.path}: {exc.strerror or exc}.") from exc


def _write(found: PromptsFile) -> None:
    found.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    try:
        if found.path.read_bytes() == found.data:
            return
    except FileNotFoundError:
        pass
    # A name of its own per write (O_EXCL): two requests of the same prompts in one process at once (gthread) each
    # write theirs, and the second rename replaces the first with the same bytes.
    fd, name = tempfile.mkstemp(dir=found.path.parent, prefix=f".{found.path.name}.", suffix=".tmp")
    temporary = Path(name)
    try:
        os.fchmod(fd, 0o640)
        view = memoryview(found.data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, found.path)

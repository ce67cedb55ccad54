"""`lora-worker jobs show`'s sample images (issue 33, docs/samples.md): each pass's images with their step LoRA,
and, with `--sheet PATH`, the contact sheet written there (steps as rows, prompts as columns)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

from lora_worker.dispatch import gallery
from lora_worker.errors import SampleNotFound
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job


def print_samples(db: Database, job: Job, out: TextIO, sheet: Path | None) -> None:
    found = gallery.listing(db, job)
    if not found["prompts"] and not found["images"]:
        return
    out.write(f"samples: {len(found['prompts'])} prompts, a pass every {found['sample_every_n_steps']} steps"
              + (f"; promoted: step {job.promoted_step}" if job.promoted_step is not None else "") + "\n")
    for i, prompt in enumerate(found["prompts"]):
        out.write(f"  prompt {i}: {prompt['prompt']!r} (seed {prompt['seed']})\n")
    for image in found["images"]:
        out.write(f"  {_step(image['step']):<12} prompt {image['prompt_index']}  {image['width']}x{image['height']}"
                  f"  sha256 {image['sha256'][:12]}  {_lora(image['lora'])}  {image['name']}\n")
    if sheet is not None:
        try:
            sheet.write_bytes(gallery.sheet(db, job))
            out.write(f"  contact sheet: {sheet}\n")
        except SampleNotFound as exc:
            out.write(f"  contact sheet: none ({exc.message})\n")


def _step(step: int) -> str:
    return "base model" if step == 0 else f"step {step}"


def _lora(lora: dict[str, Any] | None) -> str:
    if lora is None:
        return "no step LoRA"
    state = "removed" if lora["removed"] else "verified" if lora["verified"] else "not verified"
    return f"step LoRA {(lora['sha256'] or '-')[:12]} {state}"

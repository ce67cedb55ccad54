"""Which of a run's states a resume can use, before issue 32 (sd-scripts saw the kohya folder's own repeats) and
after (the worker's one-epoch presentation), for each tier × dataset × batch size: docs/resume.md's table, computed
from dispatch/presentation.py's one `presentation` (the folder's repeats, the old rule; one epoch, the new). `python -m
tests.helpers.resumable_table` prints it; tests/dispatch/test_presentation.py holds the page to it."""
from __future__ import annotations

from lora_worker.config_tables import SAVE_EVERY_N_STEPS, TIERS
from lora_worker.dispatch.presentation import Presentation, presentation

IMAGES = (5, 20, 50)
REPEATS = (1, 5, 10, 20)
BATCHES = (1, 2)


def usable(shown: Presentation) -> str:
    steps = [s.step for s in shown.states if s.resumable]
    if len(steps) == len(shown.states):
        return "all"
    return ", ".join(map(str, steps)) or "none"


def table() -> str:
    lines = []
    for tier in TIERS.values():
        every = SAVE_EVERY_N_STEPS[tier.name]
        states = ", ".join(str(s.step) for s in presentation(1, 1, tier.max_train_steps, every).states)
        lines += [f"**{tier.name}** ({tier.max_train_steps} steps, states at {states}):", "",
                  "| images × repeats | batch 1: before | batch 1: after (repeats shown) | batch 2: before "
                  "| batch 2: after (repeats shown) |", "|---|---|---|---|---|"]
        for images in IMAGES:
            for repeats in REPEATS:
                cells = []
                for batch in BATCHES:
                    before = presentation(images, batch, tier.max_train_steps, every, folder_repeats=repeats)
                    after = presentation(images, batch, tier.max_train_steps, every)
                    cells += [usable(before), f"{usable(after)} ({after.repeats})"]
                lines.append(f"| {images} × {repeats} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())

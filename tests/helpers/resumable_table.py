"""Which of a run's states a resume can use, before issue 32 (sd-scripts saw the kohya folder's own repeats, and
the tiers saved every 150/400/400 steps) and after (the worker's one-epoch presentation, and issue 33's saves every
100/300/500 steps, which divide the tiers' steps), for each tier × dataset × batch size: docs/resume.md's table,
computed from dispatch/presentation.py's one `presentation` (the folder's repeats, the old rule; one epoch, the new).
`python -m tests.helpers.resumable_table` prints it; tests/dispatch/test_presentation.py holds the page to it."""
from __future__ import annotations

from collections.abc import Mapping

from lora_worker.config_tables import SAVE_EVERY_N_STEPS, TIERS
from lora_worker.dispatch.presentation import Presentation, presentation

IMAGES = (5, 20, 50)
REPEATS = (1, 5, 10, 20)
BATCHES = (1, 2)
# The save intervals of main before issues 32 and 33 (config_tables at 809af53): none divided its tier's steps.
SAVE_EVERY_BEFORE: Mapping[str, int] = {"fast": 150, "balanced": 400, "quality": 400}


def usable(shown: Presentation) -> str:
    """The resumable states' steps, or `all` when every state before the last step is (a state at the last step
    leaves nothing to train: no resume ever uses it), or `none`."""
    steps = [s.step for s in shown.states if s.resumable]
    if len(steps) == len([s for s in shown.states if s.step < shown.max_train_steps]):
        return "all"
    return ", ".join(map(str, steps)) or "none"


def _states(steps: int, every: int) -> str:
    return ", ".join(str(s.step) for s in presentation(1, 1, steps, every).states)


def table(before: Mapping[str, int] = SAVE_EVERY_BEFORE, after: Mapping[str, int] = SAVE_EVERY_N_STEPS) -> str:
    lines = []
    for tier in TIERS.values():
        old, new = before[tier.name], after[tier.name]
        lines += [f"**{tier.name}** ({tier.max_train_steps} steps; before, states at "
                  f"{_states(tier.max_train_steps, old)}; after, at {_states(tier.max_train_steps, new)}):", "",
                  "| images × repeats | batch 1: before | batch 1: after (repeats shown) | batch 2: before "
                  "| batch 2: after (repeats shown) |", "|---|---|---|---|---|"]
        for images in IMAGES:
            for repeats in REPEATS:
                cells = []
                for batch in BATCHES:
                    was = presentation(images, batch, tier.max_train_steps, old, folder_repeats=repeats)
                    now = presentation(images, batch, tier.max_train_steps, new)
                    cells += [usable(was), f"{usable(now)} ({now.repeats})"]
                lines.append(f"| {images} × {repeats} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())

"""The sample images of a run, for every backend (issue 33, docs/samples.md): each sample pass the parser saw
(`generating sample images at step N`, `Progress.passes`) becomes, once it is over, a `SamplePass` of the images
sd-scripts wrote for it, recorded with the progress (transcript/progress.py, ledger/samples.py).

sd-scripts logs no line per image, so the images are looked for in `<output_dir>/sample/` (host/images.py: no link
followed, nothing that blocks, sizes bounded), by their names alone, parsed strictly (train_util.py L6572-6577):
`<output_name>_<NUM>_<II>_<YYYYmmddHHMMSS>_<seed>.png`, NUM `e000000` for the pass before the first step and the
step in six or more digits otherwise, II the prompt's index among the job's prompts and the seed that prompt's (the
worker gives every prompt one). An image counts once Pillow decoded it whole. Where a step and prompt have several
(an earlier run of the job sampled that step and died before its save), the newest by its name's time is this run's.

A pass is over once a `steps` redraw follows it (sd-scripts draws before the step's save and redraws after it:
train_network.py L1488-1511) or the output ended; by then the step LoRA saved after it is judged too
(transcript/checkpoints.py), and the pass names it: the images of step N are drawn with its weights.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lora_worker.ledger.checkpoints import CheckpointRow, event_data
from lora_worker.ledger.samples import SamplePass, SampleRow
from lora_worker.ledger.statements import utcnow
from lora_worker.transcript.parser import Progress

log = logging.getLogger(__name__)
EVERY = "--sample_every_n_steps="
NAME = r"_(?P<num>e000000|\d{6,})_(?P<index>\d{2})_(?P<time>\d{14})_(?P<seed>\d+)\.png"


def sample_every_of(argv: list[str]) -> int:
    """The steps between the sample passes the job's command asks for; 0: it draws none."""
    token = next((a for a in argv if a.startswith(EVERY)), "")
    return int(token[len(EVERY):]) if token[len(EVERY):].isdigit() else 0


class SampleJob(Protocol):
    @property
    def output_dir(self) -> str: ...
    @property
    def output_name(self) -> str: ...
    @property
    def output_dev_ino(self) -> str | None: ...
    @property
    def sample_prompts(self) -> list[dict[str, Any]] | None: ...


@dataclass
class Samples:
    job: SampleJob
    _taken: int = 0  # how many of the parser's passes were looked at
    _pending: list[tuple[int, int]] = field(default_factory=list)  # (step, redraws before it), not yet over

    def take(self, progress: Progress, *, ended: bool,
             lora_of: Callable[[int], CheckpointRow | None]) -> list[SamplePass]:
        """The passes over since the last call, each with its images and the step LoRA of its step."""
        self._pending += progress.passes[self._taken:]
        self._taken = len(progress.passes)
        over = [p for p in self._pending if ended or progress.redraws > p[1]]
        if not over:
            return []
        self._pending = [p for p in self._pending if p not in over]
        found = self._images({step for step, _ in over})
        passes = []
        for step, _ in over:
            lora = lora_of(step) if step > 0 else None
            passes.append(SamplePass(step, tuple(found.get(step, ())), len(self.prompts),
                                     event_data(lora) if lora is not None else None))
        return passes

    @property
    def prompts(self) -> list[dict[str, Any]]:
        return list(self.job.sample_prompts or ())

    def _images(self, steps: set[int]) -> dict[int, list[SampleRow]]:
        """The images of these steps' passes in the sample folder, decoded; what cannot be read is left out."""
        from lora_worker.host import images  # Pillow, loaded once a pass is over

        try:
            dir_fd = images.open_sample_dir(self.job.output_dir, self.job.output_dev_ino)
        except OSError as exc:
            log.warning("job's sample folder in %s cannot be read: %s", self.job.output_dir, exc)
            return {}
        try:
            chosen = self._newest(images.sample_names(dir_fd), steps)
            found: dict[int, list[SampleRow]] = {}
            for (step, index), (name, seed) in sorted(chosen.items()):
                row = self._decoded(dir_fd, name, step, index, seed)
                if row is not None:
                    found.setdefault(step, []).append(row)
            return found
        finally:
            os.close(dir_fd)

    def _newest(self, entries: list[tuple[str, os.stat_result]],
                steps: set[int]) -> dict[tuple[int, int], tuple[str, int]]:
        pattern = re.compile(re.escape(self.job.output_name) + NAME)
        prompts = self.prompts
        chosen: dict[tuple[int, int], tuple[str, int]] = {}
        times: dict[tuple[int, int], str] = {}
        for name, _ in entries:
            m = pattern.fullmatch(name)
            if m is None:
                continue
            step = 0 if m["num"] == "e000000" else int(m["num"])
            index, seed = int(m["index"]), int(m["seed"])
            if step not in steps or index >= len(prompts) or seed != prompts[index].get("seed"):
                continue
            if m["time"] >= times.get((step, index), ""):
                chosen[(step, index)], times[(step, index)] = (name, seed), m["time"]
        return chosen

    def _decoded(self, dir_fd: int, name: str, step: int, index: int, seed: int) -> SampleRow | None:
        import hashlib

        from lora_worker.host import images

        try:
            data = images.read_sample(dir_fd, name)
            width, height = images.png_size(data)
        except (OSError, images.ImageInvalid) as exc:
            log.warning("sample image %s left out: %s", name, exc)
            return None
        return SampleRow(name, step, index, seed, width, height, len(data), hashlib.sha256(data).hexdigest(),
                         utcnow())

"""What a job will be, told before it runs: the dataset as sd-scripts is shown it (`presentation`, the one place
that says how many images × repeats, steps per epoch and epochs there are, and so which states a resume can use),
the bucket table it will print, and the rest of `POST /train?dry_run=1`'s answer.

`presentation` is the one function to change when the way the dataset is handed to sd-scripts changes (issue 32:
the repeats it sees); resumable.py asks it too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lora_worker.config import Settings, Tier
from lora_worker.config_tables import tier_minutes_at_most
from lora_worker.dispatch.argv import build_argv
from lora_worker.dispatch.buckets import Bucket, bucket_table
from lora_worker.dispatch.disk import required_mib
from lora_worker.dispatch.lint import LintReport
from lora_worker.dispatch.request import ResolvedRequest
from lora_worker.transcript.eta import estimate_duration

if TYPE_CHECKING:
    from lora_worker.backends import Backend


@dataclass(frozen=True)
class Presentation:
    """The dataset as sd-scripts is shown it: its images, the repeats of the kohya folder, the batch size and the
    steps; and, when the images' buckets are known, how many fall in each (without repeats)."""

    images: int
    repeats: int
    batch_size: int
    max_train_steps: int
    bucket_sizes: tuple[int, ...] | None = None

    @property
    def images_x_repeats(self) -> int:
        return self.images * self.repeats

    @property
    def first_epoch_steps_at_least(self) -> int:
        """A lower bound of the batches of an epoch without the buckets: each bucket's are rounded up, so an epoch
        has at least ceil(images × repeats / batch size) of them."""
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


def presentation(images: int, repeats: int, batch_size: int, max_train_steps: int,
                 buckets: list[Bucket] | None = None) -> Presentation:
    sizes = None
    if buckets is not None:
        counts: dict[tuple[int, int], int] = {}
        for bucket in buckets:
            counts[bucket.resolution] = counts.get(bucket.resolution, 0) + 1
        sizes = tuple(counts[reso] for reso in sorted(counts))
    return Presentation(images, repeats, batch_size, max_train_steps, sizes)


def states(shown: Presentation, save_every: int) -> list[dict[str, Any]]:
    """Each step state the run will save (`--save_every_n_steps`), and whether a resume could start from it."""
    steps = range(save_every, shown.max_train_steps + 1, save_every) if save_every > 0 else range(0)
    return [{"step": s, "resumable": shown.state_resumable(s)} for s in steps]


def dataset_plan(shown: Presentation, buckets: list[Bucket], save_every: int) -> dict[str, Any]:
    """The dataset part of a plan: the counts sd-scripts prints and the bucket table it will print."""
    return {
        "images": shown.images, "repeats": shown.repeats, "images_x_repeats": shown.images_x_repeats,
        "batch_size": shown.batch_size, "steps_per_epoch": shown.steps_per_epoch, "epochs": shown.epochs,
        "max_train_steps": shown.max_train_steps, "states": states(shown, save_every),
        "bucket_table": bucket_table(buckets, shown.repeats).as_dict(),
    }


def estimate(history: list[float], tier: Tier) -> dict[str, Any]:
    """The job's expected wall time and what it rests on: the median of this host's finished jobs of the tier, card
    and image count ("history", as `estimated_duration_s` at acceptance), else the tier's bound ("tier_bound":
    half an hour and 6 s a step, config_tables.tier_minutes_at_most; an upper bound, not a forecast)."""
    if history:
        return {"seconds": estimate_duration(history), "basis": "history", "jobs": len(history)}
    return {"seconds": float(tier_minutes_at_most(tier) * 60), "basis": "tier_bound", "jobs": 0}


def describe(request: ResolvedRequest, settings: Settings, backend: Backend, report: LintReport, *,
             history: list[float], seconds: float) -> dict[str, Any]:
    """The plan a dry run answers: the exact argv, the dataset as sd-scripts will count and bucket it, which states
    a resume could use, the time and disk it needs, and the lint's warnings."""
    tier = request.tier
    batch_size, _ = backend.profile(settings, tier.name, request.device_index)
    buckets = report.buckets()
    shown = presentation(len(report.images), request.repeats, batch_size, request.expected.steps, buckets)
    return {
        "dry_run": True,
        "argv": build_argv(request, settings, backend),
        "dataset": dataset_plan(shown, buckets, settings.save_every_n_steps(tier.name)),
        "estimated_duration": estimate(history, tier),
        "disk_mib_at_peak": required_mib(settings.disk_mib[tier.name], tier.network_dim),
        "lint": {"warnings": [w.as_dict() for w in report.warnings], "images_decoded": report.decoded,
                 "seconds": report.seconds},
        "seconds": round(seconds, 3),
    }

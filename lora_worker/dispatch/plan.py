"""What a job will be, told before it runs: the dataset as sd-scripts is shown it (dispatch/presentation.py
`presentation`, the one place that says the repeats it sees, images × repeats, steps per epoch and epochs, and so
which states a resume can use), the dataset config the launch will write, the bucket table sd-scripts will print,
and the rest of `POST /train?dry_run=1`'s answer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lora_worker.config import Settings, Tier
from lora_worker.config_tables import tier_minutes_at_most
from lora_worker.dispatch.argv import build_argv
from lora_worker.dispatch.buckets import Bucket, bucket_table
from lora_worker.dispatch.disk import required_mib
from lora_worker.dispatch.lint import LintReport
from lora_worker.dispatch.presentation import DatasetConfig
from lora_worker.dispatch.request import ResolvedRequest
from lora_worker.dispatch.samples import disk_counts
from lora_worker.transcript.eta import estimate_duration

if TYPE_CHECKING:
    from lora_worker.backends import Backend


def dataset_plan(config: DatasetConfig, buckets: list[Bucket], *, folder_repeats: int) -> dict[str, Any]:
    """The dataset part of a plan: the counts sd-scripts prints, the states a resume could use, the bucket table it
    will print (its counts with the repeats it is shown), and the dataset config that shows it them."""
    shown = config.presentation
    return {
        "images": shown.images, "folder_repeats": folder_repeats, "repeats": shown.repeats,
        "images_x_repeats": shown.images_x_repeats, "batch_size": shown.batch_size,
        "steps_per_epoch": shown.steps_per_epoch, "epochs": shown.epochs, "max_train_steps": shown.max_train_steps,
        "states": [{"step": s.step, "resumable": s.resumable} for s in shown.states],
        "bucket_table": bucket_table(buckets, shown.repeats).as_dict(),
        "dataset_config": {"path": str(config.path), "toml": config.content.decode("utf-8")},
    }


def estimate(history: list[float], tier: Tier) -> dict[str, Any]:
    """The job's expected wall time and what it rests on: the median of this host's finished jobs of the tier, card
    and image count ("history", as `estimated_duration_s` at acceptance), else the tier's bound ("tier_bound":
    half an hour and 6 s a step, config_tables.tier_minutes_at_most; an upper bound, not a forecast)."""
    if history:
        return {"seconds": estimate_duration(history), "basis": "history", "jobs": len(history)}
    return {"seconds": float(tier_minutes_at_most(tier) * 60), "basis": "tier_bound", "jobs": 0}


def describe(request: ResolvedRequest, settings: Settings, backend: Backend, report: LintReport,
             config: DatasetConfig, *, history: list[float], seconds: float) -> dict[str, Any]:
    """The plan a dry run answers: the exact argv, the dataset as sd-scripts will be shown it, count and bucket it
    (`config`: the dataset config the launch would write, byte for byte), which states a resume could use, the time
    and disk it needs, and the lint's warnings."""
    tier = request.tier
    kept = disk_counts(request.samples, request.expected.steps, settings.save_every_n_steps(tier.name))
    return {
        "dry_run": True,
        "argv": build_argv(request, settings, backend, config),
        "dataset": dataset_plan(config, report.buckets(), folder_repeats=request.repeats),
        "estimated_duration": estimate(history, tier),
        "disk_mib_at_peak": required_mib(settings.disk_mib[tier.name], tier.network_dim, kept["step_loras"],
                                         kept["images"]),
        "lint": {"warnings": [w.as_dict() for w in report.warnings], "images_decoded": report.decoded,
                 "seconds": report.seconds},
        "seconds": round(seconds, 3),
    }

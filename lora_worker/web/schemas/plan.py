"""The shapes of the dataset lint's findings and of a dry run's plan (`POST /train?dry_run=1`, dispatch/plan.py)."""
from __future__ import annotations

import json
from typing import Any

from marshmallow import RAISE, Schema, fields, validate

from lora_worker.findings import FINDINGS


class FindingSchema(Schema):
    code = fields.String(validate=validate.OneOf(list(FINDINGS)), metadata={
        "description": "docs/errors.md, Dataset findings"})
    severity = fields.String(validate=validate.OneOf(["error", "warning"]))
    file = fields.String(metadata={"description": "the file it concerns, inside dataset_dir (`10_ohwx woman/a.png`)"})
    message = fields.String()


class StoredWarnings(fields.Field):  # type: ignore[type-arg]
    """A job's dataset warnings, from the JSON its row keeps (`dataset_warnings`); [] for a job from before."""

    def _serialize(self, value: Any, attr: str | None, obj: Any, **kwargs: Any) -> list[Any]:
        found = json.loads(value) if value else []
        return [FindingSchema().dump(f) for f in found]


def warnings_field() -> StoredWarnings:
    return StoredWarnings(attribute="dataset_warnings", dump_only=True, metadata={
        "type": "array", "items": {"$ref": "#/components/schemas/Finding"},
        "description": "what the dataset lint warned of at dispatch: trained through, but maybe not as meant"})


class SubmitQuerySchema(Schema):
    """POST /train's query. Unknown names are refused: a misspelt `dry_run` must never start a job."""

    class Meta:
        unknown = RAISE

    dry_run = fields.Boolean(load_default=False, metadata={
        "description": "1: every check of a real POST, nothing started or written; 200 with the plan"})


class BucketSchema(Schema):
    resolution = fields.List(fields.Integer(), metadata={"description": "(width, height), multiples of 64"})
    count = fields.Integer(metadata={"description": "images in it, times the repeats"})


class BucketTableSchema(Schema):
    buckets = fields.List(fields.Nested(BucketSchema))
    mean_ar_error = fields.Float()
    lines = fields.List(fields.String(), metadata={
        "description": "the lines sd-scripts will print at `make buckets`, word for word"})


class StateSchema(Schema):
    step = fields.Integer()
    resumable = fields.Boolean(metadata={"description": "whether a resume could start from the state saved there"})


class DatasetConfigSchema(Schema):
    path = fields.String(metadata={"description": "where the launch writes it: the argv's --dataset_config"})
    toml = fields.String(metadata={"description": "its content, byte for byte (docs/resume.md, One epoch covers the "
                                                  "run)"})


class DatasetPlanSchema(Schema):
    images = fields.Integer()
    folder_repeats = fields.Integer(metadata={"description": "the request's repeats: the kohya folder's name"})
    repeats = fields.Integer(metadata={"description": "the repeats sd-scripts is shown: the smallest with which one "
                                                      "epoch holds every step"})
    images_x_repeats = fields.Integer()
    batch_size = fields.Integer()
    steps_per_epoch = fields.Integer(metadata={"description": "sd-scripts' `num batches per epoch`"})
    epochs = fields.Integer()
    max_train_steps = fields.Integer()
    states = fields.List(fields.Nested(StateSchema))
    bucket_table = fields.Nested(BucketTableSchema)
    dataset_config = fields.Nested(DatasetConfigSchema)


class EstimateSchema(Schema):
    seconds = fields.Float()
    basis = fields.String(validate=validate.OneOf(["history", "tier_bound"]), metadata={
        "description": "history: the median of this host's finished jobs of the tier, card and image count; "
                       "tier_bound: no history, the tier's upper bound (30 min + 6 s a step), not a forecast"})
    jobs = fields.Integer(metadata={"description": "how many finished jobs the history holds"})


class LintSummarySchema(Schema):
    warnings = fields.List(fields.Nested(FindingSchema))
    images_decoded = fields.Integer(metadata={"description": "images decoded whole (the rest: image_not_verified)"})
    seconds = fields.Float()


class PlanSchema(Schema):
    """What `POST /train` would start, told by a dry run (docs/jobs.md, Dry run)."""

    dry_run = fields.Boolean()
    argv = fields.List(fields.String(), metadata={"description": "the exact command the job would run"})
    dataset = fields.Nested(DatasetPlanSchema)
    estimated_duration = fields.Nested(EstimateSchema)
    disk_mib_at_peak = fields.Integer(metadata={"description": "free space the output volume needs"})
    lint = fields.Nested(LintSummarySchema)
    seconds = fields.Float(metadata={"description": "how long the dry run took"})

"""The shapes of POST /train (the request, and the answer that accepts it), GET /train/<id> (the job, and its
long-poll query), POST /train/<id>/cancel and GET /train (the list)."""
from __future__ import annotations

import math
import re
import unicodedata
from typing import Any

from marshmallow import RAISE, Schema, ValidationError, fields, post_load, validate, validates

from lora_worker.config import (BACKENDS, DEFAULT_LORA_TARGETS, LORA_TARGET_PRESETS, SDXL_HPARAMS, TIERS,
                                WEBHOOK_EVENT_TYPES)
from lora_worker.config_tables import MAX_SAMPLE_PROMPTS
from lora_worker.dispatch import paths
from lora_worker.dispatch.request import TrainRequest
from lora_worker.states import CANCEL_RULE, JobState, Phase, retryable
from lora_worker.web.schemas.plan import warnings_field
from lora_worker.web.schemas.common import (EndedInPhase, FiniteFloat, FullMatch, InEffect, JsonNumber, SameObject,
                                            WhileActive, WhileActiveString, path_field)
from lora_worker.web.schemas.samples import SamplePromptOutSchema, SamplePromptSchema

# Names that become a file name, a folder name or a caption token: ASCII, no separators, no leading '-'
# (a value must never look like a flag), no control characters, bounded.
# Written so they mean the same in Python and in ECMA-262 (the OpenAPI document's dialect), and matched whole
# (FullMatch): Python's `$` alone would let a trailing newline through.
OUTPUT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TRIGGER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
SUBJECT_CLASS = re.compile(r"^[A-Za-z0-9]+(?:[ _-][A-Za-z0-9]+){0,5}$")
REPEATS = (1, 100)
SEED = (0, 2**31 - 1)
MAX_GRAD_NORM = (0.0, 10.0)


class TrainRequestSchema(Schema):
    """POST /train body. Every field is bounded; anything out of bounds is a 422, never a downgrade."""

    class Meta:
        unknown = RAISE

    dataset_dir = path_field()
    base_model_path = path_field()
    output_dir = path_field()
    output_name = fields.String(required=True, validate=FullMatch(
        OUTPUT_NAME, error="1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit."))
    trigger = fields.String(required=True, validate=FullMatch(
        TRIGGER, error="1-32 of A-Z a-z 0-9 _ -, starting with a letter or digit."))
    subject_class = fields.String(required=True, validate=[validate.Length(max=48), FullMatch(
        SUBJECT_CLASS, error="Words of A-Z a-z 0-9 separated by single spaces, '_' or '-' (at most 48 chars).")])
    repeats = fields.Integer(required=True, strict=True, validate=validate.Range(*REPEATS), metadata={
        "description": "names the kohya folder `<repeats>_<trigger> <subject_class>` in dataset_dir; sd-scripts is "
                       "shown the repeats that make one epoch hold every step (docs/resume.md)"})
    tier = fields.String(required=True, validate=validate.OneOf(list(TIERS)))
    device_index = fields.Integer(required=True, strict=True, validate=validate.Range(0, 63))
    seed = fields.Integer(required=True, strict=True, validate=validate.Range(*SEED))
    max_grad_norm = JsonNumber(load_default=None, allow_nan=False, validate=validate.Range(*MAX_GRAD_NORM))
    lora_target_modules = fields.String(load_default=None, validate=validate.OneOf(list(LORA_TARGET_PRESETS)))
    webhook_events = fields.List(fields.String(validate=validate.OneOf(list(WEBHOOK_EVENT_TYPES))),
                                 load_default=None, validate=validate.Length(max=len(WEBHOOK_EVENT_TYPES)),
                                 metadata={"description": "the webhook events this job sends, among the configured "
                                                          "ones; [] sends none; absent: every configured one. "
                                                          "Where they go is the worker's configuration alone"})
    samples = fields.List(fields.Nested(SamplePromptSchema), load_default=None,
                          validate=validate.Length(max=MAX_SAMPLE_PROMPTS), metadata={
        "description": "the prompts of the sample images, drawn before the first step and at each step save "
                       "(docs/samples.md); absent: one, `photo of <trigger> <subject_class>`; [] draws none"})

    @validates("dataset_dir", "base_model_path", "output_dir")
    def _plain_absolute_path(self, value: str, data_key: str) -> None:
        if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):
            raise ValidationError("Must not contain control characters (NUL, newline, …) or lone surrogates.")
        if unicodedata.normalize("NFC", value) != value:
            raise ValidationError("Must be in Unicode normal form NFC.")
        if not value.startswith("/") and data_key == "base_model_path":  # dataset and output: under the root
            raise ValidationError("Must be an absolute path.")
        if ".." in value.split("/"):  # `.` is harmless and normalised away (`./t1/dataset` is `t1/dataset`)
            raise ValidationError("Must not contain '..' components.")

    @validates("output_name")
    def _no_suffix(self, value: str, data_key: str) -> None:
        # sd-scripts appends the suffix itself (train_util.py L5781-5783, get_last_ckpt_name: output_name + ext)
        if value.lower().endswith(".safetensors"):
            raise ValidationError(f"Without the .safetensors suffix: sd-scripts adds it, and {value!r} would be "
                                  f"saved as {value + '.safetensors'!r}; send {value[:-len('.safetensors')]!r}.")

    @validates("max_grad_norm")
    def _finite(self, value: float | None, data_key: str) -> None:
        if value is not None and not math.isfinite(value):
            raise ValidationError("Must be a finite number.")

    @post_load
    def _make(self, data: dict[str, Any], **_: Any) -> TrainRequest:
        for key in ("dataset_dir", "base_model_path", "output_dir"):
            data[key] = paths.without_dot_components(data[key])
        if data.get("webhook_events") is not None:
            data["webhook_events"] = tuple(dict.fromkeys(data["webhook_events"]))
        if data.get("samples") is not None:
            data["samples"] = tuple(data["samples"])
        return TrainRequest(**data)


class AcceptedRequestSchema(Schema):
    """The request as the worker accepted it and the trainer was given it."""

    dataset_dir = fields.String(metadata={"description": "the resolved real path the trainer reads"})
    base_model_path = fields.String(metadata={"description": "the resolved real path the trainer loads"})
    output_dir = fields.String(metadata={"description": "the resolved real path the LoRA is written into"})
    output_name = fields.String()
    trigger = fields.String()
    subject_class = fields.String()
    repeats = fields.Integer()
    tier = fields.String(validate=validate.OneOf(list(TIERS)))
    device_index = fields.Integer()
    seed = fields.Integer()
    max_grad_norm = InEffect(fields.Float(), float(SDXL_HPARAMS["max_grad_norm"]), metadata={
        "type": "number",
        "description": f"as in effect: {SDXL_HPARAMS['max_grad_norm']} when the request left it out"})
    lora_target_modules = InEffect(fields.String(), DEFAULT_LORA_TARGETS, metadata={
        "type": "string", "enum": list(LORA_TARGET_PRESETS),
        "description": f"as in effect: {DEFAULT_LORA_TARGETS} when the request left it out"})
    samples = InEffect(fields.List(fields.Nested(SamplePromptOutSchema)), [], attribute="sample_prompts", metadata={
        "type": "array", "items": {"type": "object", "properties": {"prompt": {"type": "string"},
                                                                     "seed": {"type": "integer"}}},
        "description": "the sample prompts as in effect, each with its seed; []: none (a job from before "
                       "samples drew none)"})


class CheckpointSchema(Schema):
    """A step LoRA the trainer wrote and still keeps (`<output_name>-step%08d.safetensors`)."""

    step = fields.Integer(metadata={"description": "the optimizer step the trainer saved it at (its name's)"})
    path = fields.String()
    bytes = fields.Integer(allow_none=True)
    sha256 = fields.String(allow_none=True, metadata={"description": "of the file that verified; null otherwise"})
    verified = fields.Boolean(allow_none=True, metadata={
        "description": "checked as the final LoRA is (header, rank, dtype, name, seed, steps) and its ss_steps "
                       "equal to `step`; null until the trainer has moved on past its save"})
    error = fields.String(allow_none=True, metadata={"description": "why it did not verify"})


class StepLoras(fields.List):  # type: ignore[type-arg]
    """The job's step LoRAs from its `checkpoints` rows: the states and the ones the trainer removed left out."""

    def _serialize(self, value: Any, attr: str | None, obj: Any, **kwargs: Any) -> list[Any] | None:
        kept = [c for c in value or () if c.kind == "lora" and c.removed_at is None]
        return super()._serialize(sorted(kept, key=lambda c: c.step), attr, obj, **kwargs)


class JobSchema(Schema):
    """A job as `GET /train/<id>` shows it."""

    worker_job_id = fields.Integer(attribute="id")
    status = fields.String(validate=validate.OneOf([s.value for s in JobState]))
    phase = fields.String(allow_none=True, validate=validate.OneOf([p.value for p in Phase]), metadata={
        "description": "what the trainer is doing; once the job ended, the phase it ended in (kept as it was: "
                       "`saving` after a success, e.g. `loading_model` after an early cancel; null if it never "
                       "started). `ended_in_phase` says the same, and only for a finished job"})
    ended_in_phase = EndedInPhase(attribute="phase", dump_only=True, allow_none=True,
                                  validate=validate.OneOf([p.value for p in Phase]), metadata={
        "description": "the phase a finished job ended in; null while it is queued or running, and for a job "
                       "that ended before it started (cancelled while queued, its supervisor never started)"})
    request = SameObject(AcceptedRequestSchema, metadata={
        "description": "the request as accepted: its values, the defaults it took, the resolved paths"})
    step = fields.Integer()
    total_steps = fields.Integer()
    loss = FiniteFloat(allow_none=True, metadata={"description": "avr_loss; null when absent or not finite (nan)"})
    rate = fields.Float(allow_none=True, metadata={"description": "optimizer steps per second"})
    eta_s = WhileActive(allow_none=True, metadata={
        "description": "seconds left until the job ends, the LoRA's save, the trainer's teardown and the file's "
                       "verification included; counts down between steps; null unless queued or running "
                       "(and before training, when no similar job has finished yet)"})
    lora_path = fields.String(allow_none=True)
    checkpoints = StepLoras(fields.Nested(CheckpointSchema), dump_only=True, metadata={
        "description": "the step LoRAs the trainer keeps (with samples, each sampled one; else the newest: it "
                       "saves one every few hundred steps and removes the older), each verified once written; "
                       "the job's result is `lora_path` alone: the final LoRA, or the one promoted"})
    promoted_step = fields.Integer(allow_none=True, metadata={
        "description": "the step whose verified step LoRA POST /train/<id>/promote made the result (`lora_path`, "
                       "`lora_sha256`); null: the final LoRA is"})
    error = fields.String(allow_none=True)
    failure_class = fields.String(allow_none=True)
    retryable = fields.Method("_retryable", dump_only=True, allow_none=True, metadata={
        "type": "boolean", "description": "whether the same request, sent again unchanged, may pass where this "
                                          "failure ended it (docs/errors.md, Failure classes); null unless failed"})
    exit_code = fields.Integer(allow_none=True)
    signal = fields.Integer(allow_none=True)
    tier = fields.String()
    device_index = fields.Integer()
    train_id = fields.String()
    dataset_dir = fields.String(metadata={"description": "the resolved real path the trainer was given"})
    output_dir = fields.String(metadata={"description": "the resolved real path the trainer was given"})
    output_name = fields.String()
    seed = fields.Integer()
    image_count = fields.Integer()
    created_at = fields.DateTime(format="iso")
    started_at = fields.DateTime(format="iso", allow_none=True)
    finished_at = fields.DateTime(format="iso", allow_none=True)
    updated_at = fields.DateTime(format="iso")
    cancel_requested_at = fields.DateTime(format="iso", allow_none=True)
    last_progress_at = fields.DateTime(format="iso", allow_none=True)
    training_started_at = fields.DateTime(format="iso", allow_none=True)
    version = fields.Integer(metadata={"description": "bumped by every change; pass it as ?since= to long-poll"})
    estimated_duration_s = fields.Float(allow_none=True, metadata={
        "description": "median wall time of similar finished jobs (tier, device, image count) at acceptance"})
    eta_basis = WhileActiveString(allow_none=True, validate=validate.OneOf(["measured", "history"]), metadata={
        "description": "what eta_s rests on: the measured step rate from the first step on (plus the save and "
                       "teardown of finished jobs of this tier and device), or the history estimate before it"})
    lora_sha256 = fields.String(allow_none=True)
    lora_size = fields.Integer(allow_none=True)
    sd_scripts_commit = fields.String(allow_none=True)
    trainer_versions = fields.Dict(keys=fields.String(), values=fields.String(), allow_none=True)
    dataset_sha256 = fields.String(allow_none=True, metadata={"description": "hash of image names, sizes, captions"})
    base_model_sha256 = fields.String(allow_none=True)
    backend = fields.String(validate=validate.OneOf(list(BACKENDS)), metadata={
        "description": "where the job runs: this host's supervisor (local) or a Slurm cluster (slurm)"})
    slurm_job_id = fields.String(allow_none=True, metadata={"description": "Slurm's id of the job; null for local"})
    queue_reason = fields.String(allow_none=True, metadata={
        "description": "why Slurm keeps the queued job waiting (Resources, Priority, …); null otherwise"})
    resumed_from = fields.Integer(allow_none=True, metadata={"description": "the job this one resumes; null: none"})
    attempt = fields.Integer(metadata={"description": "which try of the request this is: 1, or a resume's count"})
    resume_step = fields.Integer(metadata={"description": "the step a resume started from (0: not a resume)"})
    warnings = warnings_field()

    def _retryable(self, job: Any) -> bool | None:
        return retryable(job.status, job.failure_class)


class CancelAnswerSchema(JobSchema):
    """POST /train/<id>/cancel's answer: the job, and the rule of how it will end."""

    cancel_rule = fields.Constant(CANCEL_RULE, metadata={"description": "how a cancelled job ends"})


class AcceptedSchema(Schema):
    worker_job_id = fields.Integer(attribute="id")
    status = fields.String()
    estimated_duration_s = fields.Float(allow_none=True)
    warnings = warnings_field()


IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,128}")  # matched whole (fullmatch)


class CancelQuerySchema(Schema):
    """POST /train/<id>/cancel: with `wait`, answer once the job has ended, or after that many seconds."""

    class Meta:
        unknown = RAISE

    wait = fields.Float(load_default=None, allow_nan=False, validate=validate.Range(0, 60, min_inclusive=False),
                        metadata={"description": "seconds to wait for the job to end (more than 0, at most 60)",
                                  "exclusiveMinimum": True})


class StatusQuerySchema(Schema):
    """GET /train/<id>: with `since`, wait up to `wait` seconds for the job's version to change."""

    class Meta:
        unknown = RAISE

    wait = fields.Float(load_default=0.0, allow_nan=False, validate=validate.Range(0, 25))
    since = fields.Integer(load_default=None, validate=validate.Range(0, 2**62))


class JobListSchema(Schema):
    jobs = fields.List(fields.Nested(JobSchema))
    next_before_id = fields.Integer(allow_none=True)


class JobListQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    status = fields.List(fields.String(validate=validate.OneOf([s.value for s in JobState])), load_default=list)
    limit = fields.Integer(load_default=50, validate=validate.Range(1, 500))
    before_id = fields.Integer(load_default=None, validate=validate.Range(1, 2**63 - 1))

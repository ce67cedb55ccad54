"""The shapes of sample images (issue 33, docs/samples.md): a request's prompts, `GET /train/<id>/samples` and
`POST /train/<id>/promote`."""
from __future__ import annotations

import unicodedata

from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates

from lora_worker.config_tables import MAX_SAMPLE_PROMPT_CHARS, SAMPLE_SAMPLER, SAMPLE_SCALE, SAMPLE_SEED

SEED = (0, 2**31 - 1)


class SamplePromptSchema(Schema):
    """One prompt of `samples`: drawn at the tier's resolution before the first step and at each step save."""

    class Meta:
        unknown = RAISE

    prompt = fields.String(required=True, validate=validate.Length(min=1, max=MAX_SAMPLE_PROMPT_CHARS))
    seed = fields.Integer(load_default=None, strict=True, validate=validate.Range(*SEED), metadata={
        "description": f"fixed for every step of the job; absent: {SAMPLE_SEED} + the prompt's index"})

    @validates("prompt")
    def _one_line(self, value: str, data_key: str) -> None:
        # The trainer logs each prompt on a line of its own: a line break would forge a line of the run log.
        if any(unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") for ch in value):
            raise ValidationError("Must be one line: no control characters (newline, tab, …) or line separators.")
        if not value.strip():
            raise ValidationError("Must not be blank.")


class SamplePromptOutSchema(Schema):
    prompt = fields.String()
    seed = fields.Integer()


class StepLoraSchema(Schema):
    """The step LoRA an image belongs to: saved right after its pass, with the weights it was drawn with."""

    step = fields.Integer()
    path = fields.String()
    sha256 = fields.String(allow_none=True)
    bytes = fields.Integer(allow_none=True)
    verified = fields.Boolean(allow_none=True, metadata={"description": "null until judged"})
    removed = fields.Boolean(metadata={"description": "the trainer pruned it: gone from the disk"})
    job_id = fields.Integer(metadata={"description": "the job (of a resume's chain) that saved it"})


class SampleImageSchema(Schema):
    name = fields.String(metadata={"description": "the file in <output_dir>/sample/; GET .../samples/<name>"})
    step = fields.Integer(metadata={"description": "0: before the first step, the base model's look"})
    prompt_index = fields.Integer()
    prompt = fields.String(allow_none=True)
    seed = fields.Integer(allow_none=True)
    width = fields.Integer()
    height = fields.Integer()
    bytes = fields.Integer()
    sha256 = fields.String(metadata={"description": "of the file as it was decoded when listed; served only so"})
    job_id = fields.Integer(metadata={"description": "the job (of a resume's chain) whose trainer drew it"})
    lora = fields.Nested(StepLoraSchema, allow_none=True, metadata={
        "description": "the step LoRA of the same step; null at step 0 and where none was written"})


class SamplesSchema(Schema):
    """GET /train/<id>/samples."""

    worker_job_id = fields.Integer()
    prompts = fields.List(fields.Nested(SamplePromptOutSchema), metadata={"description": "[]: the job draws none"})
    sample_every_n_steps = fields.Integer(metadata={"description": "the steps between passes (the step saves')"})
    sampler = fields.Constant(SAMPLE_SAMPLER)
    scale = fields.Constant(SAMPLE_SCALE)
    promoted_step = fields.Integer(allow_none=True)
    images = fields.List(fields.Nested(SampleImageSchema), metadata={
        "description": "every image of the job and of the jobs it resumed, by step then prompt"})
    contact_sheet = fields.String(metadata={"description": "GET this path for the sheet (steps × prompts, PNG)"})


class PromoteSchema(Schema):
    """POST /train/<id>/promote."""

    class Meta:
        unknown = RAISE

    step = fields.Integer(required=True, strict=True, validate=validate.Range(1, 10**9), metadata={
        "description": "a step whose step LoRA was verified and is still on disk"})


class PromotedSchema(Schema):
    worker_job_id = fields.Integer()
    promoted_step = fields.Integer()
    lora_path = fields.String()
    lora_sha256 = fields.String()
    lora_size = fields.Integer()
    changed = fields.Boolean(metadata={"description": "false when the step was the result already (idempotent)"})

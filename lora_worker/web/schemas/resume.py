"""The shapes of GET /train/<id>/resume (whether and from where the job can be resumed) and of the answer that
accepts POST /train/<id>/resume."""
from __future__ import annotations

from marshmallow import Schema, fields, validate

from lora_worker.errors import RESUME_REASONS
from lora_worker.web.schemas.job import AcceptedSchema


class ResumeReasonSchema(Schema):
    code = fields.String(validate=validate.OneOf(list(RESUME_REASONS)), metadata={
        "description": "a stable code (docs/errors.md, Resume refusals)"})
    message = fields.String(metadata={"description": "what was found, naming the state it is about"})


class ResumeVerdictSchema(Schema):
    worker_job_id = fields.Integer()
    resumable = fields.Boolean()
    from_step = fields.Integer(allow_none=True, metadata={
        "description": "the step the resume would start from: the newest state that passes every check"})
    state = fields.String(allow_none=True, metadata={"description": "that state's directory"})
    reasons = fields.List(fields.Nested(ResumeReasonSchema), metadata={
        "description": "why the job, or each newer state, was refused (empty: nothing was)"})


class ResumeAcceptedSchema(AcceptedSchema):
    resumed_from = fields.Integer(metadata={"description": "the job this one continues"})
    attempt = fields.Integer(metadata={"description": "which try of the request this is (1: its own request)"})
    resume_step = fields.Integer(metadata={"description": "the step it starts from"})

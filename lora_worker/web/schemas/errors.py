"""The one shape of every error answer (lora_worker/errors.py is the catalogue of reasons)."""
from __future__ import annotations

from marshmallow import Schema, fields


class ErrorSchema(Schema):
    """Every error, whatever its status: a machine reason, a sentence, and details where there are some."""

    error = fields.String(required=True, metadata={"description": "machine-readable reason, e.g. job_active"})
    message = fields.String(required=True)
    status = fields.Integer(required=True)
    retryable = fields.Boolean(required=True, metadata={
        "description": "whether the same request, unchanged, may succeed later by waiting alone"})
    fields_ = fields.Dict(data_key="fields", keys=fields.String(), values=fields.List(fields.String()))
    details = fields.Dict()

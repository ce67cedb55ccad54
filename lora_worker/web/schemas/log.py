"""The shapes of GET /train/<id>/log and GET /train/<id>/progress."""
from __future__ import annotations

from marshmallow import RAISE, Schema, fields, validate

from lora_worker.web.schemas.common import FiniteFloat


class ProgressQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    points = fields.Integer(load_default=200, validate=validate.Range(1, 5000))


class ProgressPointSchema(Schema):
    step = fields.Integer()
    loss = FiniteFloat(allow_none=True)
    t = fields.Float(metadata={"description": "seconds since the job started"})


class ProgressSeriesSchema(Schema):
    worker_job_id = fields.Integer()
    total_steps = fields.Integer()
    points = fields.List(fields.Nested(ProgressPointSchema))


class LogQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    lines = fields.Integer(load_default=None, validate=validate.Range(0, 10_000))
    offset = fields.Integer(load_default=None, validate=validate.Range(0, 2**62))
    limit = fields.Integer(load_default=256 * 1024, validate=validate.Range(1, 1 << 20))


class LogSchema(Schema):
    worker_job_id = fields.Integer()
    text = fields.String()
    offset = fields.Integer(metadata={"description": "logical offset just past `text`; pass it back as ?offset="})
    skipped = fields.Integer(metadata={"description": "bytes dropped from the middle of a huge log"})

"""The webhook routes: what became of each event of a job, and sending one again."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify
from marshmallow import Schema, fields, validate

from lora_worker.config import WEBHOOK_EVENT_TYPES
from lora_worker.web import worker

bp = Blueprint("deliveries", __name__)

STATES = ["pending", "retrying", "delivered", "given_up"]


class AttemptSchema(Schema):
    at = fields.String(metadata={"description": "when the request left (ISO-8601 UTC)"})
    finished_at = fields.String(allow_none=True, metadata={"description": "null while in flight, or if the "
                                                                         "sender stopped during it"})
    status_code = fields.Integer(allow_none=True, metadata={"description": "the receiver's HTTP status; null "
                                                                          "when none came (refused, timed out)"})
    latency_ms = fields.Float(allow_none=True)
    error = fields.String(allow_none=True)


class DeliverySchema(Schema):
    event_id = fields.String(metadata={"description": "the `webhook-id` header: stable across attempts"})
    type = fields.String(validate=validate.OneOf(list(WEBHOOK_EVENT_TYPES)))
    state = fields.String(validate=validate.OneOf(STATES), metadata={
        "description": "pending (not tried yet), retrying (tried, will be again), delivered (a 2xx came), "
                       "given_up (410 Gone, or not delivered within webhook_give_up_s)"})
    created_at = fields.String()
    next_attempt_at = fields.String(allow_none=True)
    delivered_at = fields.String(allow_none=True)
    last_error = fields.String(allow_none=True)
    attempts = fields.List(fields.Nested(AttemptSchema))


class DeliveriesSchema(Schema):
    worker_job_id = fields.Integer()
    events = fields.List(fields.Nested(DeliverySchema))


@bp.get("/train/<int:job_id>/deliveries")
def deliveries(job_id: int) -> Response:
    """Each webhook event of the job, oldest first, with each attempt to deliver it."""
    return jsonify(DeliveriesSchema().dump({"worker_job_id": job_id, "events": worker().deliveries(job_id)}))


@bp.post("/train/<int:job_id>/deliveries/<string:event_id>/redeliver")
def redeliver(job_id: int, event_id: str) -> tuple[Response, int]:
    """202: the event is pending again and goes next, under its own id (a receiver that saw it may drop it)."""
    return jsonify(DeliverySchema().dump(worker().redeliver(job_id, event_id))), 202

"""The training routes of the client contract: dispatch, status, log, cancel, and the job list."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify, request

from lora_worker.api import worker
from lora_worker.api.schemas import (AcceptedSchema, JobListQuerySchema, JobListSchema, JobSchema, LogQuerySchema,
                                     LogSchema, TrainRequestSchema)

bp = Blueprint("train", __name__)


@bp.post("/train")
def submit() -> tuple[Response, int]:
    train_request = TrainRequestSchema().load(_json_body())
    job = worker().submit(train_request)
    return jsonify(AcceptedSchema().dump(job)), 202


@bp.get("/train")
def list_jobs() -> Response:
    query = JobListQuerySchema().load({**request.args, "status": request.args.getlist("status")})
    jobs = worker().jobs(status=query["status"], limit=query["limit"], before_id=query["before_id"])
    next_before = jobs[-1].id if len(jobs) == query["limit"] else None
    return jsonify(JobListSchema().dump({"jobs": jobs, "next_before_id": next_before}))


@bp.get("/train/<int:job_id>")
def status(job_id: int) -> Response:
    return jsonify(JobSchema().dump(worker().job(job_id)))


@bp.get("/train/<int:job_id>/log")
def job_log(job_id: int) -> Response:
    query = LogQuerySchema().load(request.args)
    chunk = worker().log(job_id, lines=query["lines"], offset=query["offset"], limit=query["limit"])
    return jsonify(LogSchema().dump({"worker_job_id": job_id, "text": chunk.text, "offset": chunk.offset,
                                     "skipped": chunk.skipped}))


@bp.post("/train/<int:job_id>/cancel")
def cancel(job_id: int) -> tuple[Response, int]:
    return jsonify(JobSchema().dump(worker().cancel(job_id))), 202


def _json_body() -> object:
    # force=True: parse whatever the content type says; a body that is not JSON is a 400.
    return request.get_json(force=True)

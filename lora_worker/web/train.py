"""The training routes of the client contract: dispatch, status, log, cancel, and the job list."""
from __future__ import annotations

import hashlib
import json

from flask import Blueprint, Response, jsonify, request
from werkzeug.exceptions import BadRequest

from lora_worker.web import worker
from lora_worker.web.schemas.job import (
    IDEMPOTENCY_KEY,
    AcceptedSchema,
    CancelAnswerSchema,
    CancelQuerySchema,
    JobListQuerySchema,
    JobListSchema,
    JobSchema,
    StatusQuerySchema,
    TrainRequestSchema,
)
from lora_worker.web.schemas.plan import PlanSchema, SubmitQuerySchema
from lora_worker.web.schemas.resume import ResumeAcceptedSchema, ResumeVerdictSchema
from lora_worker.web.schemas.log import LogQuerySchema, LogSchema, ProgressQuerySchema, ProgressSeriesSchema
from lora_worker.errors import InvalidRequest
from lora_worker.states import TERMINAL_STATES, JobState

bp = Blueprint("train", __name__)


@bp.post("/train")
def submit() -> tuple[Response, int]:
    """202 for a new job; 200 with the original job when an Idempotency-Key is replayed with the same body; with
    `?dry_run=1`, 200 with the plan of the job it would start, having started and written nothing (an
    Idempotency-Key is neither looked up nor kept)."""
    query = SubmitQuerySchema().load(request.args)
    body = _json_body()
    train_request = TrainRequestSchema().load(body)  # type: ignore[arg-type]
    if query["dry_run"]:
        return jsonify(PlanSchema().dump(worker().plan(train_request))), 200
    job, created = worker().submit(train_request, idempotency_key=_idempotency_key(), body_sha256=_digest(body))
    return jsonify(AcceptedSchema().dump(job)), 202 if created else 200


@bp.get("/train")
def list_jobs() -> Response:
    query = JobListQuerySchema().load({**request.args, "status": request.args.getlist("status")})
    jobs = worker().jobs(status=query["status"], limit=query["limit"], before_id=query["before_id"])
    next_before = jobs[-1].id if len(jobs) == query["limit"] else None
    return jsonify(JobListSchema().dump({"jobs": jobs, "next_before_id": next_before}))


@bp.get("/train/<int:job_id>")
def status(job_id: int) -> Response:
    """With `since` and `wait`, a long poll; one that found no free slot is answered at once with the job and a
    `Retry-After`: wait that long before polling again."""
    query = StatusQuerySchema().load(request.args)
    polled = worker().job(job_id, wait_s=query["wait"], since=query["since"])
    response = jsonify(JobSchema().dump(polled.job))
    if polled.retry_after_s is not None:
        response.headers["Retry-After"] = str(polled.retry_after_s)
    return response


@bp.get("/train/<int:job_id>/progress")
def progress(job_id: int) -> Response:
    query = ProgressQuerySchema().load(request.args)
    job, series = worker().progress(job_id, query["points"])
    start = job.started_at or job.created_at
    points = [{"step": p.step, "loss": p.loss, "t": round((p.at - start).total_seconds(), 3)} for p in series]
    return jsonify(ProgressSeriesSchema().dump({"worker_job_id": job.id, "total_steps": job.total_steps,
                                                "points": points}))


@bp.get("/train/<int:job_id>/log")
def job_log(job_id: int) -> Response:
    query = LogQuerySchema().load(request.args)
    chunk = worker().log(job_id, lines=query["lines"], offset=query["offset"], limit=query["limit"])
    return jsonify(LogSchema().dump({"worker_job_id": job_id, "text": chunk.text, "offset": chunk.offset,
                                     "skipped": chunk.skipped}))


@bp.post("/train/<int:job_id>/cancel")
def cancel(job_id: int) -> tuple[Response, int]:
    """202 with the job, as soon as the cancel is recorded; with `?wait=S`, 200 once the job has ended within
    those seconds (202 with its state then if it has not)."""
    query = CancelQuerySchema().load(request.args)
    job = worker().cancel(job_id, wait_s=query["wait"] or 0.0)
    ended = query["wait"] is not None and JobState(job.status) in TERMINAL_STATES
    return jsonify(CancelAnswerSchema().dump(job)), 200 if ended else 202


@bp.get("/train/<int:job_id>/resume")
def resume_verdict(job_id: int) -> Response:
    """Whether the job can be resumed and from which state; every reason a state (or the job) was refused."""
    return jsonify(ResumeVerdictSchema().dump({"worker_job_id": job_id, **worker().resume_verdict(job_id)}))


@bp.post("/train/<int:job_id>/resume")
def resume(job_id: int) -> tuple[Response, int]:
    """202 with the new job that resumes this one; 200 with it when an Idempotency-Key is replayed."""
    job, created = worker().resume(job_id, idempotency_key=_idempotency_key())
    return jsonify(ResumeAcceptedSchema().dump(job)), 202 if created else 200


def _json_body() -> object:
    """The body parsed as JSON whatever the content type says; one that is not JSON is a 400 whose message says
    where it breaks (werkzeug's own sentence is written for a browser)."""
    try:
        return json.loads(request.get_data(cache=True))
    except RecursionError as exc:  # thousands of nested brackets: the parser's recursion limit, not a bug of ours
        raise BadRequest("The JSON body is nested too deeply.") from exc
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes in no UTF encoding
        raise BadRequest(f"The body is not valid JSON: {exc}.") from exc


def _idempotency_key() -> str | None:
    key = request.headers.get("Idempotency-Key")
    if key is not None and not IDEMPOTENCY_KEY.fullmatch(key):
        raise InvalidRequest({"Idempotency-Key": ["1-128 visible ASCII characters."]})
    return key


def _digest(body: object) -> str:
    """The body's identity for idempotency: the same JSON in any key order or spacing hashes the same."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()

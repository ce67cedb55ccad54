"""The ledger's tables. The alembic migrations create exactly this schema (a test runs `alembic check`)."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, CheckConstraint, Float, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from lora_worker.ledger.statements import iso_utc, parse_utc, utcnow as utcnow  # noqa: F401 - utcnow: one clock for both paths
from lora_worker.states import ACTIVE_STATES, FailureClass, JobState, Phase


class UtcTimestamp(TypeDecorator[datetime]):
    """An aware UTC datetime stored as ISO-8601 text (`2026-11-30T04:57:12.123Z`), readable in sqlite3."""

    impl = String(24)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> str | None:
        return None if value is None else iso_utc(value)  # the supervisor's sqlite3 path writes the same text

    def process_result_value(self, value: str | None, dialect: Dialect) -> datetime | None:
        return parse_utc(value)


def _in(column: str, values: Any) -> str:
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


# The partial index and the CHECKs are plain SQL so the migration and the model say the same thing.
ACTIVE_WHERE = _in("status", sorted(ACTIVE_STATES, key=lambda s: s.value))
STATUS_CHECK = _in("status", JobState)
PHASE_CHECK = "phase IS NULL OR " + _in("phase", Phase)
FAILURE_CHECK = "failure_class IS NULL OR " + _in("failure_class", FailureClass)


class Base(DeclarativeBase):
    pass


class Job(Base):
    """One training request and everything that happened to it."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # A real column under the one-active-job index: a local job takes the one training slot of this host
    # ("train"); a Slurm job one of `slurm-0` … `slurm-<max_active_jobs - 1>` (dispatch picks the first free).
    slot: Mapped[str] = mapped_column(String(16), server_default="train")
    status: Mapped[str] = mapped_column(String(16))
    phase: Mapped[str | None] = mapped_column(String(32))
    # The request, after validation (paths are the resolved real paths the trainer receives).
    train_id: Mapped[str] = mapped_column(String(128))
    dataset_dir: Mapped[str] = mapped_column(Text)
    base_model_path: Mapped[str] = mapped_column(Text)
    output_dir: Mapped[str] = mapped_column(Text)
    output_name: Mapped[str] = mapped_column(String(128))
    trigger: Mapped[str] = mapped_column(String(64))
    subject_class: Mapped[str] = mapped_column(String(64))
    repeats: Mapped[int] = mapped_column(Integer)
    tier: Mapped[str] = mapped_column(String(16))
    device_index: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(Integer)
    max_grad_norm: Mapped[float | None] = mapped_column(Float)
    lora_target_modules: Mapped[str | None] = mapped_column(String(32))
    image_count: Mapped[int] = mapped_column(Integer)
    # The exact command and environment, built once at dispatch and executed verbatim.
    argv: Mapped[list[str]] = mapped_column(JSON)
    env: Mapped[dict[str, str]] = mapped_column(JSON)
    # The LoRA the run must produce, recorded once at dispatch; the supervisor holds the file to these and to
    # nothing read at the end of the run. Its name is `output_name` and its seed is `seed` (neither is ever
    # written again). Its steps get their own column: `total_steps` is the progress bar's total, which the
    # supervisor overwrites with whatever the trainer reports.
    lora_file: Mapped[str] = mapped_column(Text)  # <output_dir>/<output_name>.safetensors
    lora_rank: Mapped[int] = mapped_column(Integer)  # every lora_down weight's shape[0]; ss_network_dim
    lora_steps: Mapped[int] = mapped_column(Integer)  # ss_max_train_steps
    lora_dtype: Mapped[str] = mapped_column(String(8))  # of every lora_down/lora_up tensor ("F32")
    # Progress, as parsed from the trainer's output.
    step: Mapped[int] = mapped_column(Integer, server_default="0")
    total_steps: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    rate: Mapped[float | None] = mapped_column(Float)  # optimizer steps per second
    eta_s: Mapped[float | None] = mapped_column(Float)
    last_progress_at: Mapped[datetime | None] = mapped_column(UtcTimestamp)
    # Outcome.
    lora_path: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    failure_class: Mapped[str | None] = mapped_column(String(32))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    signal: Mapped[int | None] = mapped_column(Integer)
    # Times.
    created_at: Mapped[datetime] = mapped_column(UtcTimestamp)
    started_at: Mapped[datetime | None] = mapped_column(UtcTimestamp)
    finished_at: Mapped[datetime | None] = mapped_column(UtcTimestamp)
    updated_at: Mapped[datetime] = mapped_column(UtcTimestamp)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UtcTimestamp)
    # Who runs the job: (boot id, pid, start time in clock ticks) never mistakes a reused pid for ours.
    boot_id: Mapped[str | None] = mapped_column(String(36))
    supervisor_pid: Mapped[int | None] = mapped_column(Integer)
    supervisor_start_ticks: Mapped[int | None] = mapped_column(Integer)
    trainer_pid: Mapped[int | None] = mapped_column(Integer)  # also the trainer's process group id
    trainer_start_ticks: Mapped[int | None] = mapped_column(Integer)
    # Bumped by every update, so a client can wait for "anything new".
    version: Mapped[int] = mapped_column(Integer, server_default="1")
    # Idempotent dispatch: the client's key and a hash of the body it came with.
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    request_sha256: Mapped[str | None] = mapped_column(String(64))
    # The verified artifact.
    lora_sha256: Mapped[str | None] = mapped_column(String(64))
    lora_size: Mapped[int | None] = mapped_column(Integer)
    # Reproducibility fingerprint.
    sd_scripts_commit: Mapped[str | None] = mapped_column(String(64))
    trainer_versions: Mapped[dict[str, str] | None] = mapped_column(JSON)
    dataset_sha256: Mapped[str | None] = mapped_column(String(64))
    base_model_sha256: Mapped[str | None] = mapped_column(String(64))
    # Honest time: the estimate at acceptance, when the steps bar first moved, and what eta_s rests on.
    estimated_duration_s: Mapped[float | None] = mapped_column(Float)
    training_started_at: Mapped[datetime | None] = mapped_column(UtcTimestamp)
    eta_basis: Mapped[str | None] = mapped_column(String(16))  # "history" before training, then "measured"

    # "<st_dev>:<st_ino>" of the directories as dispatch checked them; the supervisor compares before exec.
    dataset_dev_ino: Mapped[str | None] = mapped_column(String(48))
    kohya_dev_ino: Mapped[str | None] = mapped_column(String(48))
    output_dev_ino: Mapped[str | None] = mapped_column(String(48))

    # Where the job runs (backends.py): "local" (a supervisor on this host) or "slurm" (a batch job the
    # poller follows); for Slurm, its job id once sbatch accepted it, and why it waits while it is PENDING.
    backend: Mapped[str] = mapped_column(String(8), server_default="local")
    slurm_job_id: Mapped[str | None] = mapped_column(String(32))
    queue_reason: Mapped[str | None] = mapped_column(String(64))
    # Which webhook events the job sends (ledger/outbox.py `Subscription`, JSON), fixed at dispatch; NULL: none.
    webhook_events: Mapped[str | None] = mapped_column(Text)
    # A resume (dispatch/resume.py, migration 0014): the job whose saved state this one continues, which try
    # of the request this is (1: its own request), and the step of the state it starts from (0: none).
    resumed_from: Mapped[int | None] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, server_default="1")
    resume_step: Mapped[int] = mapped_column(Integer, server_default="0")
    base_model_identity: Mapped[str | None] = mapped_column(String(96))  # dev:ino:size:mtime_ns:ctime_ns at dispatch
    # The dataset lint's warnings at dispatch (JSON list of findings, lora_worker/findings.py; migration 0016).
    dataset_warnings: Mapped[str | None] = mapped_column(Text)
    # Sample images (migration 0017): the prompts, each {prompt, seed} ([]: none; NULL: a job from before), and
    # the step whose verified step LoRA a client promoted to be the result (NULL: the final LoRA is).
    sample_prompts: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    promoted_step: Mapped[int | None] = mapped_column(Integer)

    events: Mapped[list[JobEvent]] = relationship(back_populates="job", order_by="JobEvent.id",
                                                  passive_deletes=True)
    # Loaded with the job (one more SELECT for any number of jobs): GET /train/<id> lists the step LoRAs.
    checkpoints: Mapped[list[Checkpoint]] = relationship(order_by="Checkpoint.id", lazy="selectin", viewonly=True)

    __table_args__ = (
        CheckConstraint(STATUS_CHECK, name="status_valid"),
        CheckConstraint(PHASE_CHECK, name="phase_valid"),
        CheckConstraint(FAILURE_CHECK, name="failure_class_valid"),
        Index("one_active_job", "slot", unique=True, sqlite_where=text(ACTIVE_WHERE)),
        # At most one active job per LoRA file, on every backend: a second save would overwrite the first's
        # verified LoRA (migration 0011; repository.create_job answers 409 job_active naming the holder).
        Index("one_active_job_per_lora", "lora_file", unique=True, sqlite_where=text(ACTIVE_WHERE)),
        Index("ix_jobs_status_id", "status", "id"),
        Index("ix_jobs_idempotency_key", "idempotency_key", unique=True,
              sqlite_where=text("idempotency_key IS NOT NULL")),
        Index("ix_jobs_history", "tier", "device_index", "image_count", "status"),
        Index("ix_jobs_resumed_from", "resumed_from"),
        # The failed jobs of one class without reading every failed row: reconcile's look for the jobs a reboot
        # cut off runs on every start-up and /metrics scrape (migration 0015).
        Index("ix_jobs_status_failure_class", "status", "failure_class", "id"),
        {"sqlite_autoincrement": True},  # ids are never reused, not even after prune (migration 0007)
    )


class JobEvent(Base):
    """One change of a job: a state transition, or a flag such as a cancel request (from == to)."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UtcTimestamp)
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(16))  # api | supervisor | reconcile | cli | watchdog
    reason: Mapped[str | None] = mapped_column(Text)

    job: Mapped[Job] = relationship(back_populates="events")


class ProgressPoint(Base):
    """The loss curve: the latest avr_loss seen at each optimizer step."""

    __tablename__ = "job_progress"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    loss: Mapped[float | None] = mapped_column(Float)
    at: Mapped[datetime] = mapped_column(UtcTimestamp)


class JobCount(Base):
    """An aggregate /metrics serves (jobs by status, failures by class, run-time buckets, reconcile actions),
    kept by triggers as rows change (migration 0008), so a scrape does not scan the history."""

    __tablename__ = "job_counts"

    metric: Mapped[str] = mapped_column(String(32), primary_key=True)
    label: Mapped[str] = mapped_column(String(96), primary_key=True)
    n: Mapped[float] = mapped_column(Float, server_default="0")


class WebhookEvent(Base):
    """One event of a job for arbo's webhook, written with the change it tells of (ledger/outbox.py)."""

    __tablename__ = "webhook_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # orders a job's events
    event_id: Mapped[str] = mapped_column(String(40))  # the `webhook-id` header: stable across attempts
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(32))
    body: Mapped[str] = mapped_column(Text)  # the exact bytes every attempt sends
    created_at: Mapped[str] = mapped_column(String(24))
    state: Mapped[str] = mapped_column(String(16))  # pending | delivered | given_up
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    next_attempt_at: Mapped[str] = mapped_column(String(24))
    give_up_at: Mapped[str] = mapped_column(String(24))
    delivered_at: Mapped[str | None] = mapped_column(String(24))
    last_error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        CheckConstraint("state IN ('pending', 'delivered', 'given_up')", name="webhook_state_valid"),
        Index("ix_webhook_events_event_id", "event_id", unique=True),
        Index("ix_webhook_events_job", "job_id", "state", "id"),
        Index("ix_webhook_events_due", "state", "next_attempt_at"),
        {"sqlite_autoincrement": True},
    )


class WebhookAttempt(Base):
    """One try at delivering an event: opened before the request leaves, closed with its answer."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    event_pk: Mapped[int] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"), index=True)
    started_at: Mapped[str] = mapped_column(String(24))
    finished_at: Mapped[str | None] = mapped_column(String(24))
    status_code: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)


class Checkpoint(Base):
    """A step LoRA or a state the job's trainer announced (migration 0013; ledger/checkpoints.py writes them)."""

    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))  # lora | state
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(UtcTimestamp)  # when its save line was seen
    bytes: Mapped[int | None] = mapped_column(Integer)
    sha256: Mapped[str | None] = mapped_column(String(64))
    verified: Mapped[bool | None] = mapped_column(Boolean)  # None: not checked (yet, or a state)
    error: Mapped[str | None] = mapped_column(Text)
    removed_at: Mapped[datetime | None] = mapped_column(UtcTimestamp)  # the trainer pruned it

    __table_args__ = (
        CheckConstraint("kind IN ('lora', 'state')", name="checkpoint_kind_valid"),
        Index("ix_checkpoints_job_kind_path", "job_id", "kind", "path", unique=True),
        {"sqlite_autoincrement": True},
    )


class Sample(Base):
    """A sample image the job's trainer drew, as its follower found and decoded it (ledger/samples.py)."""

    __tablename__ = "samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))  # in <output_dir>/sample/
    step: Mapped[int] = mapped_column(Integer)  # 0: before the first step (the base model's look)
    prompt_index: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int | None] = mapped_column(Integer)
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(UtcTimestamp)  # when the follower found it

    __table_args__ = (Index("ix_samples_job_name", "job_id", "name", unique=True), {"sqlite_autoincrement": True})

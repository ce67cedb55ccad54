"""`lora-worker jobs …`: the ledger for an operator at a terminal: ls, show, watch, log [-f], cancel [--all],
prune.

It talks to the ledger directly, not to the HTTP API, so it works while the web service is stopped (a
`systemctl stop` leaves training running; `jobs cancel --all` is how to stop it). Like a request, every
command first reconciles the jobs it touches, so a dead supervisor never shows as running. Results go to
stdout; one log line per thing done, with its job id, goes to stderr (journald).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TextIO

from lora_worker.config import Settings
from lora_worker.errors import JobFinished
from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job
from lora_worker.reconcile import current_job, reconcile
from lora_worker.states import ACTIVE_STATES, JobState
from lora_worker.backends import backend_of
from lora_worker.transcript.logreader import LogReader
from lora_worker.ops.retention import prune
from lora_worker.ops.samples import print_samples
from lora_worker.ops.watch import describe_curve, watch

log = logging.getLogger("lora_worker.jobs")

FOLLOW_POLL_S = 0.5
LOG_CHUNK = 1 << 20
WAIT_MARGIN_S = 60.0  # past the cancel grace, for the trainer's group to be reaped and the row written


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    jobs = sub.add_parser("jobs", help="list, show, follow, cancel and prune jobs in the ledger")
    cmd = jobs.add_subparsers(dest="jobs_command", required=True)
    ls = cmd.add_parser("ls", help="recent jobs, newest first, as a table")
    ls.add_argument("--status", action="append", choices=[s.value for s in JobState], default=[])
    ls.add_argument("--limit", type=_positive_int, default=20)
    show = cmd.add_parser("show", help="one job, its sample images and its event history")
    show.add_argument("job_id", type=_positive_int)
    show.add_argument("--sheet", type=Path, metavar="PATH", help="write the samples' contact sheet (PNG) there")
    live = cmd.add_parser("watch", help="a job live until it ends: progress, ETA, loss curve, log (0 if it succeeded)")
    live.add_argument("job_id", nargs="?", type=_positive_int, help="default: the active job")
    follow = cmd.add_parser("log", help="a job's run log")
    follow.add_argument("job_id", type=_positive_int)
    follow.add_argument("-f", "--follow", action="store_true", help="keep printing until the job has ended")
    cancel = cmd.add_parser("cancel", help="ask one job, or every active job, to stop")
    which = cancel.add_mutually_exclusive_group(required=True)
    which.add_argument("job_id", nargs="?", type=_positive_int)
    which.add_argument("--all", action="store_true", help="every queued or running job")
    cancel.add_argument("--wait", action="store_true", help="return once the jobs have ended")
    cmd.add_parser("deliveries", help="a job's webhook events and each attempt to deliver them").add_argument(
        "job_id", type=_positive_int)
    old = cmd.add_parser("prune", help="forget finished jobs past retention: rows, events and run logs")
    old.add_argument("--older-than", type=_days, metavar="DAYS", help="default: the retention_days setting")
    old.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")


def run(settings: Settings, args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    # The same refusal as the service's: no ledger, or an old schema.
    from lora_worker.ledger.migrate import check_ledger

    check_ledger(settings)
    db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s)
    try:
        return COMMANDS[args.jobs_command](db, settings, args, out)
    finally:
        db.dispose()


# -- commands ------------------------------------------------------------------------------------------------

def cmd_ls(db: Database, settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    reconcile(db, settings, actor="cli")
    jobs = repo.list_jobs(db, status=args.status, limit=args.limit)
    header = ("ID", "STATUS", "PHASE", "TIER", "GPU", "STEPS", "CREATED", "RUN", "RESULT")
    rows = [(str(j.id), j.status, j.phase or "-", j.tier, str(j.device_index), f"{j.step}/{j.total_steps}",
             _time(j.created_at), _run_time(j), _result(j)) for j in jobs]
    _table(out, header, rows)
    return 0


def cmd_show(db: Database, settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    job = current_job(db, settings, args.job_id, actor="cli")
    fields = {
        "status": job.status + (f" ({job.phase})" if job.phase else ""),
        "tier": f"{job.tier} on device {job.device_index}, seed {job.seed}",
        "dataset": f"{job.dataset_dir} ({job.image_count} images x {job.repeats} repeats)",
        "output": job.lora_file,
        "progress": _progress(job),
        "loss curve": describe_curve([p.loss for p in repo.progress_points(db, job.id)]) or None,
        "created": _time(job.created_at), "started": _time(job.started_at), "finished": _time(job.finished_at),
        "run time": _run_time(job), "cancel requested": _time(job.cancel_requested_at),
        "lora": job.lora_path, "failure": job.failure_class, "exit code": job.exit_code, "signal": job.signal,
        "error": job.error,
    }
    out.write(f"job {job.id}\n")
    for name, value in fields.items():
        if value not in (None, "-"):
            # A multi-line value (the error and its log tail) stays in the value column.
            text = textwrap.indent(str(value), " " * 20).lstrip()
            out.write(f"  {name + ':':<18}{text}\n")
    warnings = json.loads(job.dataset_warnings) if job.dataset_warnings else []
    out.write(f"lint: {len(warnings)} warning(s) of the dataset at dispatch\n" if job.dataset_warnings is not None
              else "lint: none recorded (a job from before the lint)\n")
    out.writelines(f"  {w['code']}: {w['file']}: {w['message']}\n" for w in warnings)
    print_samples(db, job, out, args.sheet)
    out.write("events:\n")
    events = repo.job_events(db, job.id)
    _table(out, ("AT", "FROM", "TO", "ACTOR", "REASON"),
           [(_time(e.at), e.from_status or "-", e.to_status, e.actor, e.reason or "") for e in events], indent=2)
    return 0


def cmd_watch(db: Database, settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    job_id = args.job_id
    if job_id is None:
        reconcile(db, settings, actor="cli")
        active = repo.active_job(db)
        if active is None:
            out.write("no active job; name one: lora-worker jobs watch ID (lora-worker jobs ls lists them)\n")
            return 1
        job_id = active.id
    return watch(db, settings, job_id, out)


def cmd_log(db: Database, settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    try:
        return _print_log(db, settings, current_job(db, settings, args.job_id, actor="cli"), args.follow, out)
    except KeyboardInterrupt:  # the usual way to stop following
        return 130
    except OSError as exc:  # a link or a FIFO where the log was: refused at once (host/fs.py `open_in`)
        out.write(f"lora-worker: the run log of job {args.job_id} cannot be read: {exc}\n")
        return 1


def _print_log(db: Database, settings: Settings, job: Job, follow: bool, out: TextIO) -> int:
    reader, offset = LogReader(settings.log_dir, job.id), 0
    while True:
        chunk = reader.read_from(offset, LOG_CHUNK)
        if chunk.skipped:
            out.write(f"[lora-worker] … {chunk.skipped} bytes of this log were dropped …\n")
        out.write(chunk.text)
        out.flush()
        if chunk.offset != offset:
            offset = chunk.offset
            continue
        if not follow or JobState(job.status) not in ACTIVE_STATES:
            return 0
        time.sleep(FOLLOW_POLL_S)
        # Read the row after the log: once it says "ended", one more pass of the loop drains the last bytes.
        job = current_job(db, settings, job.id, actor="cli")


def cmd_cancel(db: Database, settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    reconcile(db, settings, actor="cli")
    targets = [j.id for j in repo.active_jobs(db)] if args.all else [args.job_id]
    if not targets:
        out.write("no active job\n")
    for job_id in targets:
        try:
            runs = backend_of(repo.get_job(db, job_id))
            job = repo.request_cancel(db, job_id, actor="cli", reason="cancel requested by an operator",
                                      queued_at_once=runs.cancels_queued_at_once)
        except JobFinished:
            if args.all:
                continue  # it ended between the listing and the request: nothing left to stop
            raise
        if job.status == JobState.RUNNING.value:
            # As the API does: wake the supervisor now rather than at its next ledger poll (0.5 s). A
            # supervisor of another user cannot be signalled; then the poll it is left to stops it.
            runs.wake(job)
        log.info("job %s: cancel requested", job_id, extra={"job": job_id})
        out.write(f"job {job_id}: {'cancelled' if job.status == JobState.CANCELLED.value else 'cancel requested'}\n")
    if args.wait and targets:
        return _wait_until_ended(db, settings, targets, out)
    return 0


def cmd_deliveries(db: Database, settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    job = repo.get_job(db, args.job_id)
    with db.reading() as d:
        events = outbox.deliveries(d, job.id)
    if not events:
        out.write(f"job {job.id} has no webhook events" + ("" if settings.webhook_url else
                                                          " (no webhook_url is configured)") + "\n")
        return 0
    for e in events:
        out.write(f"{e['event_id']}  {e['type']:<14} {e['state']:<9} written {e['created_at']}"
                  + (f"  next {e['next_attempt_at']}" if e["next_attempt_at"] else "") + "\n")
        _table(out, ("AT", "STATUS", "MS", "ERROR"), [
            (a["at"], str(a["status_code"] or "-"), f"{a['latency_ms']:.0f}" if a["latency_ms"] is not None
             else "-", a["error"] or "") for a in e["attempts"]], indent=2)
    return 0


def cmd_prune(db: Database, settings: Settings, args: argparse.Namespace, out: TextIO) -> int:
    days = settings.retention_days if args.older_than is None else args.older_than
    done = prune(db, settings, older_than_days=days, dry_run=args.dry_run)
    verb = "would prune" if args.dry_run else "pruned"
    others = (f", and {len(done.other_files)} lock file(s), partial LoRA(s), state(s) and dataset config(s)"
              if done.other_files else "")
    out.write(f"{verb} {len(done.job_ids)} job(s) finished before {_time(done.cutoff)} and "
              f"{len(done.log_files)} log file(s){others}\n")
    return 0


COMMANDS: dict[str, Callable[[Database, Settings, argparse.Namespace, TextIO], int]] = {
    "ls": cmd_ls, "show": cmd_show, "watch": cmd_watch, "log": cmd_log, "cancel": cmd_cancel, "prune": cmd_prune,
    "deliveries": cmd_deliveries,
}


# -- helpers -------------------------------------------------------------------------------------------------

def _wait_until_ended(db: Database, settings: Settings, job_ids: Sequence[int], out: TextIO) -> int:
    deadline = time.monotonic() + settings.cancel_grace_s + WAIT_MARGIN_S
    pending = list(job_ids)
    while pending and time.monotonic() < deadline:
        time.sleep(FOLLOW_POLL_S)
        pending = [i for i in pending if JobState(current_job(db, settings, i, actor="cli").status) in ACTIVE_STATES]
    for job_id in job_ids:
        out.write(f"job {job_id}: {repo.get_job(db, job_id).status}\n")
    return 1 if pending else 0


def _table(out: TextIO, header: Sequence[str], rows: Sequence[Sequence[str]], indent: int = 0) -> None:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths[:-1], strict=True)]
        out.write(" " * indent + "  ".join([*cells, row[-1]]).rstrip() + "\n")


def _time(at: datetime | None) -> str:
    return "-" if at is None else at.strftime("%Y-%m-%d %H:%M:%SZ")


def _run_time(job: Job) -> str:
    if job.started_at is None:
        return "-"
    end = job.finished_at or datetime.now(job.started_at.tzinfo)
    seconds = max(0, round((end - job.started_at).total_seconds()))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _progress(job: Job) -> str:
    parts = [f"{job.step}/{job.total_steps} steps"]
    if job.loss is not None:
        parts.append(f"loss {job.loss:.4f}")
    if job.rate:
        parts.append(f"{job.rate:.2f} steps/s")
    if job.eta_s is not None and job.status in (s.value for s in ACTIVE_STATES):
        parts.append(f"eta {job.eta_s:.0f} s")  # a finished job has none left, whatever an old row kept
    return ", ".join(parts)


def _result(job: Job) -> str:
    if job.status == JobState.SUCCEEDED.value:
        return job.lora_path or ""
    if job.cancel_requested_at is not None and job.status in (s.value for s in ACTIVE_STATES):
        return "cancel requested"
    return job.failure_class or ""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


MAX_DAYS = 100_000  # ~270 years: past this, a cutoff date does not exist


def _days(text: str) -> float:
    value = float(text)
    if not 0 <= value <= MAX_DAYS:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_DAYS} days, not {text}")
    return value


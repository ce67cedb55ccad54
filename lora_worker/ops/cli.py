"""`lora-worker`: the operator's commands (migrate, reconcile, serve, jobs …, doctor, check-ledger, config, demo,
smoke, plan)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from lora_worker.ops import banner
from lora_worker.ops import demo as demo_cli
from lora_worker.ops import jobs as jobs_cli
from lora_worker.ops import plan as plan_cli
from lora_worker.ops import smoke as smoke_cli
from lora_worker.config import Settings, load_settings
from lora_worker.errors import ConfigError, LedgerCorrupt, LoraWorkerError
from lora_worker.logs import configure_logging

log = logging.getLogger("lora_worker.ops.cli")


def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    from lora_worker.ledger.migrate import current_revision, migrate

    highest = migrate(settings, getattr(args, "to", "head"))  # state dir, schema, job ids above any ever run
    print(f"ledger {settings.database_path} at schema {current_revision(settings.database_path)}"
          + (f"; next job id above {highest}" if highest is not None else ""))
    return 0


def cmd_reconcile(settings: Settings, args: argparse.Namespace) -> int:
    from lora_worker.ledger.migrate import check_ledger, prepare_state_dir
    from lora_worker.ledger.db import Database
    from lora_worker.reconcile import reconcile

    prepare_state_dir(settings)
    check_ledger(settings)
    db = Database.open(settings.database_path, busy_timeout_s=settings.busy_timeout_s)
    try:
        actions = reconcile(db, settings, actor="cli")
    finally:
        db.dispose()
    for action in actions:
        print(f"job {action.job_id}: failed ({action.failure_class.value})"
              + (f", killed {list(action.killed)}" if action.killed else ""))
    print(f"reconciled: {len(actions)} job(s) marked failed")
    return 0


def cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    """Migrate, reconcile, then exec gunicorn with the shipped configuration."""
    banner.refuse_open_bind(settings, args.bind)
    cmd_migrate(settings, args)
    cmd_reconcile(settings, args)
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "systemd",
                        "gunicorn.conf.py")
    gunicorn = os.path.join(os.path.dirname(sys.executable), "gunicorn")
    # Without --bind, gunicorn.conf.py takes the `bind` setting (config file or LORA_WORKER_BIND).
    bind = ["--bind", args.bind] if args.bind else []
    os.execv(gunicorn, [gunicorn, "-c", conf, *bind, "lora_worker.wsgi:app"])
    return 0  # not reached


def cmd_doctor(settings: Settings, args: argparse.Namespace) -> int:
    """The checks behind dispatch, for this host; non-zero exit when something needed is missing."""
    from lora_worker.checks import tally
    from lora_worker.ops.doctor import run_checks
    from lora_worker.host.nvml import make_nvml

    checks = run_checks(settings, make_nvml(settings.nvml_timeout_s, settings.nvml_fake_file), strict=args.strict)
    for check in checks:
        print(check.line(), flush=True)
    print(tally(checks))
    failed = [c.name for c in checks if c.failed]
    unchecked = [c.name for c in checks if not c.checked] if args.strict else []
    if args.strict and failed:
        print("doctor --strict: this host cannot train: " + ", ".join(failed))
    if unchecked:  # --strict proves that jobs can run: what could not be checked is not proven
        print("doctor --strict: not checked, so not proven: " + ", ".join(unchecked))
    return 1 if failed or unchecked else 0


def cmd_check_ledger(settings: Settings, args: argparse.Namespace) -> int:
    """The full integrity check, every page, read-only (what the daily timer runs; `doctor` makes the same one).

    No start makes it: its cost grows with the file (about 1 s per GB), so every start checks a bounded part
    and this check runs beside the service, at idle priority."""
    from lora_worker.ledger.migrate import verify_integrity

    path = settings.database_path
    if not path.exists():
        raise ConfigError(f"No ledger at {path}; run `lora-worker migrate` first.")
    size = path.stat().st_size
    started = time.monotonic()
    try:
        verify_integrity(path)
    except LedgerCorrupt as exc:
        print(f"lora-worker check-ledger: {exc.message}. The file is left as it is (never repaired). Stop the "
              f"service and restore {path} from a backup; or move it aside and run `lora-worker migrate` for a "
              "new one (job ids continue above every job that left a run log).", file=sys.stderr)
        return 1
    print(f"ledger {path}: ok ({human_size(size)} checked in {time.monotonic() - started:.2f} s)")
    return 0


def human_size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def cmd_jobs(settings: Settings, args: argparse.Namespace) -> int:
    return jobs_cli.run(settings, args)


def cmd_config(settings: Settings, args: argparse.Namespace) -> int:
    banner.refuse_open_bind(settings, args.bind)  # first: `make run` stops here, before gunicorn's traceback
    banner.describe(settings, sys.stdout, bind=args.bind)
    return 0


def cmd_smoke(settings: Settings, args: argparse.Namespace) -> int:
    return smoke_cli.run(settings, args)


def cmd_plan(settings: Settings, args: argparse.Namespace) -> int:
    return plan_cli.run(settings, args)


def cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    return demo_cli.run(args)  # its own simulated host: the caller's settings are not used


COMMANDS: dict[str, Callable[[Settings, argparse.Namespace], int]] = {
    "migrate": cmd_migrate,
    "reconcile": cmd_reconcile,
    "serve": cmd_serve,
    "doctor": cmd_doctor,
    "check-ledger": cmd_check_ledger,
    "jobs": cmd_jobs,
    "demo": cmd_demo,
    "smoke": cmd_smoke,
    "plan": cmd_plan,
    "config": cmd_config,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora-worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    migrate = sub.add_parser("migrate", help="create or upgrade the ledger schema")
    migrate.add_argument("--to", default="head", metavar="REVISION",
                         help="up or down to this schema revision (default: the code's head); before a rollback, "
                              "the newer code takes the ledger down to the older code's head")
    sub.add_parser("reconcile", help="mark active jobs whose supervisor died as failed")
    doctor = sub.add_parser("doctor", help="check NVML, devices, the trainer install, state dir and train root")
    doctor.add_argument("--strict", action="store_true",
                        help="also start the trainer in its sandbox (torch, CUDA, bitsandbytes): exit 1 unless "
                             "this host can train")
    sub.add_parser("check-ledger", help="read every page of the ledger (read-only; exit 1 if it is damaged)")
    serve = sub.add_parser("serve", help="migrate, reconcile and run gunicorn")
    serve.add_argument("--bind", default=None, help="override the `bind` setting (default 127.0.0.1:8203)")
    jobs_cli.add_parser(sub)
    demo_cli.add_parser(sub)
    smoke_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    banner.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings()
        status = COMMANDS[args.command](settings, args)
        sys.stdout.flush()  # here, not at exit: a closed pipe must surface where it is handled below
        return status
    except LoraWorkerError as exc:
        print(f"lora-worker {args.command}: {exc.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        die_of_closed_pipe()
        return 141  # not reached


def die_of_closed_pipe() -> None:
    """End the way coreutils do when the reader went away (`jobs ls | head -1`): quietly, by SIGPIPE.

    Python ignores SIGPIPE and raises BrokenPipeError instead; left alone that is a traceback, and at exit
    another one from flushing stdout. Point stdout at /dev/null so nothing more is written, then take the
    signal's default action, so the shell sees 141 as it would from `cat`."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)


if __name__ == "__main__":
    sys.exit(main())

"""Schema migrations (alembic, from the repository's `migrations/`) and the start-up checks of the ledger.

alembic is imported only where a migration runs: the web worker checks the schema version on every start, and
alembic alone is ~10 MiB of its resident memory (its head revision is read from the migration files instead).
"""
from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lora_worker.config import REPO_ROOT, Settings
from lora_worker.errors import ConfigError, LedgerCorrupt

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = REPO_ROOT / "migrations"
RUN_LOG_NAME = re.compile(r"job-([0-9]+)\.")  # job-<id>.log, job-<id>.tail.log, and logs moved aside
# A revision file's own id and its parents', as alembic writes them (`revision: str = "0008"` too).
REVISION_LINE = re.compile(r"^(revision|down_revision)\b[^=\n]*=(.*)$", re.M)
QUOTED = re.compile(r"""["']([^"']+)["']""")


def alembic_config(db_path: Path) -> Config:
    """An alembic Config for `db_path`, built in code so no alembic.ini is needed."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", f"sqlite:///{db_path}")
    return cfg


def allow_batch_rename(dbapi_conn: sqlite3.Connection, _record: object = None) -> None:
    """A connect hook for every connection that migrates (env.py uses it).

    Batch mode rebuilds a table by copy, drop and rename. SQLite's modern RENAME re-checks every view, and the
    operator views (0003) name `jobs`, which is missing at that instant, so the rename fails. The legacy rename
    leaves views as they are; they find the rebuilt table under its old name.
    """
    dbapi_conn.execute("PRAGMA legacy_alter_table=ON")


def upgrade(db_path: Path, revision: str = "head") -> None:
    """Bring the ledger to `revision` (up, or down to an older one), never migrating a damaged file.

    This runs at every service start (`lora-worker migrate`, the unit's ExecStartPre), so a ledger already at
    `revision` gets the bounded check only. Every page is read only when a revision is about to rewrite the
    file: a migration copies tables, and a damaged page copied is a damage made permanent."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    if db_path.exists():
        verify_structure(db_path)  # first: the schema version below is read from what it checks
        refuse_newer_ledger(db_path)
        target = head_revision() if revision == "head" else revision
        current = current_revision(db_path)
        if current != target:
            verify_integrity(db_path)
        if current is not None and target in ancestors(current):
            from alembic import command

            command.downgrade(alembic_config(db_path), target)
            return
    from alembic import command

    command.upgrade(alembic_config(db_path), revision)


def refuse_newer_ledger(db_path: Path) -> None:
    """Code rolled back onto a ledger a newer release migrated: refuse in one line that says how to go back.

    This code cannot downgrade a revision it has never seen (the downgrade is in the newer code's migration
    file), so the newer code must, before this one starts."""
    current, known = current_revision(db_path), known_revisions()
    if current is not None and current not in known:
        head = head_revision()
        raise ConfigError(f"Ledger {db_path} is at schema {current}, newer than this code's {head} (a rollback?); "
                          f"downgrade it with the newer code first: `lora-worker migrate --to {head}`, "
                          "then start this one.")


def known_revisions() -> dict[str, list[str]]:
    """Every revision in `migrations/versions`, with its parents, read without importing alembic."""
    revisions: dict[str, list[str]] = {}
    for path in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        fields = {name: QUOTED.findall(value) for name, value in REVISION_LINE.findall(path.read_text())}
        if fields.get("revision"):
            revisions[fields["revision"][0]] = fields.get("down_revision", [])
    return revisions


def ancestors(revision: str) -> set[str]:
    """The revisions below `revision` (not itself): the ones `migrate --to` goes down to."""
    revisions, found, todo = known_revisions(), set(), list(known_revisions().get(revision, []))
    while todo:
        parent = todo.pop()
        if parent not in found:
            found.add(parent)
            todo.extend(revisions.get(parent, []))
    return found


def head_revision() -> str:
    """The schema the code needs: the one revision in `migrations/versions` that no other revises (what
    alembic's `get_current_head` says; tests/ledger holds them equal), read without importing alembic."""
    revisions = known_revisions()
    revised = {parent for parents in revisions.values() for parent in parents}
    heads = sorted(set(revisions) - revised)
    if len(heads) != 1:
        raise ConfigError(f"The migrations in {MIGRATIONS_DIR} have {len(heads)} heads ({', '.join(heads)}), "
                          "not one.")
    return heads[0]


def current_revision(db_path: Path) -> str | None:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.OperationalError:
        return None  # no alembic_version table: never migrated
    finally:
        conn.close()
    return row[0] if row else None


# What a start-up check reads whole: the schema (page 1 and the header with it), the schema version and the
# ledger's few small tables. None of them grows with the history, so neither does the check, and every start
# (a gunicorn worker's, or `lora-worker migrate` at the unit's ExecStartPre) makes it. The full check, every
# page of every table and index, runs where its file-sized cost is not paid per start: `lora-worker
# check-ledger` (a daily systemd timer, systemd/lora-worker-check.timer.in), `lora-worker doctor`, and
# `upgrade` before it applies a revision.
BOUNDED_TABLES = ("sqlite_master", "alembic_version", "sqlite_sequence", "job_counts")


def verify_integrity(db_path: Path) -> None:
    """Refuse a damaged ledger loudly, without touching it (no repair, no rewrite): every page is read."""
    _quick_check(db_path, lambda conn: ["PRAGMA quick_check"])


def verify_structure(db_path: Path) -> None:
    """The start-up check: what `verify_integrity` promises, for the header, the schema and the small tables
    only, at a cost that does not grow with the file. A damaged page of the job history is left to the full
    check (see BOUNDED_TABLES)."""
    def statements(conn: sqlite3.Connection) -> list[str]:
        present = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return [f"PRAGMA quick_check({table})" for table in BOUNDED_TABLES
                if table == "sqlite_master" or table in present]
    _quick_check(db_path, statements)


def _quick_check(db_path: Path, statements: Callable[[sqlite3.Connection], list[str]]) -> None:
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        try:
            rows = [row for sql in statements(conn) for row in conn.execute(sql).fetchall() if row != ("ok",)]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise LedgerCorrupt(f"ledger {db_path} is not a readable SQLite database: {exc}") from exc
    if rows:
        detail = "; ".join(str(r[0]) for r in rows[:5])
        raise LedgerCorrupt(f"ledger {db_path} failed PRAGMA quick_check: {detail}")


def migrate(settings: Settings, revision: str = "head") -> int | None:
    """`lora-worker migrate [--to REV]`: the state dir, the schema, then the job ids; returns the highest id
    ever given."""
    if revision != "head" and revision not in known_revisions():
        raise ConfigError(f"No schema revision {revision!r} in {MIGRATIONS_DIR / 'versions'}; this code knows "
                          f"{', '.join(sorted(known_revisions()))}.")
    prepare_state_dir(settings)
    upgrade(settings.database_path, revision)
    # Below the head (a rollback in progress) the older code seeds the ids when it migrates.
    return seed_job_ids(settings) if current_revision(settings.database_path) == head_revision() else None


def seed_job_ids(settings: Settings) -> int:
    """Make the next job id higher than any job this host ever ran, even if the ledger was recreated.

    AUTOINCREMENT (migration 0007) keeps ids unique within one ledger file. A new, empty ledger would start at 1
    again, and arbo would take job 1 for the one it knew; every job that ran left a run log named by its id,
    so the sequence is raised to the highest of those. Idempotent: it only ever raises it."""
    try:
        names = os.listdir(settings.log_dir)
    except FileNotFoundError:
        names = []
    highest_log = max((int(m[1]) for name in names if (m := RUN_LOG_NAME.match(name))), default=0)
    conn = sqlite3.connect(settings.database_path, isolation_level=None, timeout=settings.busy_timeout_s)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE sqlite_sequence SET seq = max(seq, ?, (SELECT coalesce(max(id), 0) FROM jobs)) "
                     "WHERE name = 'jobs'", (highest_log,))
        (seq,) = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
        conn.execute("COMMIT")
    finally:
        conn.close()
    return int(seq)


def prepare_state_dir(settings: Settings) -> None:
    for directory in (settings.state_dir, settings.lock_dir, settings.log_dir, settings.gpu_locks,
                      settings.hf_home_dir):
        directory.mkdir(parents=True, exist_ok=True)


def check_ledger(settings: Settings) -> None:
    """Refuse to serve from a damaged ledger or one whose schema is not the code's.

    Run on every worker start (and by the commands that read the ledger), so it checks only what does not grow
    with the history (`verify_structure`); `check-ledger`, `doctor` and a migration read every page."""
    path = settings.database_path
    if not path.exists():
        raise ConfigError(f"No ledger at {path}{_which_worker()}; run `lora-worker migrate` first.")
    verify_structure(path)
    refuse_newer_ledger(path)
    current, head = current_revision(path), head_revision()
    if current is None:
        raise ConfigError(f"Ledger {path} was never migrated{_which_worker()}; run `lora-worker migrate` first.")
    if current != head:
        raise ConfigError(f"Ledger {path} is at schema {current}, the code needs {head}; "
                          "run `lora-worker migrate`.")


def _which_worker() -> str:
    """A missing ledger under the built-in settings is most often the wrong worker's: say which settings these
    are, before the advice to make a new ledger."""
    if os.environ.get("LORA_WORKER_CONFIG") or os.environ.get("LORA_WORKER_STATE_DIR"):
        return ""
    return (" (the built-in settings: neither LORA_WORKER_CONFIG nor LORA_WORKER_STATE_DIR is set; for another "
            "worker's ledger point LORA_WORKER_CONFIG at its config, e.g. LORA_WORKER_CONFIG=var/demo/worker.toml "
            "for `make demo`'s)")

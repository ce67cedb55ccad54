"""Ledgers for tests: a migrated one in 0.3 ms, the columns of a valid job, and a row as an old schema holds it."""
from __future__ import annotations

import atexit
import json
import shutil
import sqlite3
import tempfile
from pathlib import Path

from lora_worker.ledger.migrate import upgrade
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState

_template: list[Path] = []  # the one ledger this process migrated, once


def migrated_ledger(path: Path) -> Path:
    """`path` becomes a ledger at the head revision: a copy of one this test process migrated once.

    Running alembic costs 0.17 s a ledger (seconds on a loaded machine) against 0.3 ms to copy the file; the
    migrations keep their own tests (tests/ledger, tests/slurm/test_migration.py), which still call `upgrade`,
    and tests/ledger/test_template.py holds the copy equal to a ledger migrated in place."""
    if not _template:
        directory = Path(tempfile.mkdtemp(prefix="lw-ledger-template-"))
        atexit.register(shutil.rmtree, directory, True)
        upgrade(directory / "ledger.sqlite3")
        leftovers = sorted(p.name for p in directory.iterdir() if p.name != "ledger.sqlite3")
        assert not leftovers, f"the migrated ledger left {leftovers} beside it: a copy of the file alone is not it"
        _template.append(directory / "ledger.sqlite3")
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_template[0], path)
    return path

def old_row(path: Path, status: str) -> int:
    """A row as a 0008 ledger holds it (the ORM already knows the new columns)."""
    cols = {**columns(), "status": status, "created_at": "2026-12-01T10:00:00.000Z",
            "updated_at": "2026-12-01T10:00:00.000Z", "finished_at": "2026-12-01T10:01:00.000Z", "step": 0,
            "version": 1}
    cols["argv"], cols["env"] = json.dumps(cols["argv"]), json.dumps(cols["env"])
    conn = sqlite3.connect(path)
    try:
        with conn:
            names = ", ".join(f'"{c}"' for c in cols)
            cur = conn.execute(f"INSERT INTO jobs ({names}) VALUES ({', '.join('?' * len(cols))})",
                               tuple(cols.values()))
        return int(cur.lastrowid)
    finally:
        conn.close()


def columns(**overrides: object) -> dict:
    cols = {
        "train_id": "t1", "dataset_dir": "/train/t1/dataset", "base_model_path": "/models/m.safetensors",
        "output_dir": "/train/t1/output", "output_name": "ohwx", "trigger": "ohwx", "subject_class": "woman",
        "repeats": 10, "tier": "fast", "device_index": 1, "seed": 42, "image_count": 3,
        "argv": ["accelerate", "launch"], "env": {"PATH": "/usr/bin"}, "total_steps": 400,
        "lora_file": "/train/t1/output/ohwx.safetensors", "lora_rank": 16, "lora_steps": 400, "lora_dtype": "F32",
    }
    cols.update(overrides)
    return cols


def sql(path: Path, query: str, *params: object) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        with conn:
            return conn.execute(query, params).fetchall()
    finally:
        conn.close()


def triggers(path: Path) -> list[tuple]:
    return sql(path, "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' ORDER BY name")


def running_job(db, **identity: object) -> int:
    """A job the supervisor marked running (with `identity`), written straight to the ledger."""
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", **identity)
    return job.id


# The columns migrations after 0015 added to `jobs`: today's ORM names them in every INSERT and SELECT, so a test of
# an older migration that reads or writes through it adds them (a plain ADD COLUMN, as those migrations do).
LATER_COLUMNS = {"dataset_warnings": "TEXT",  # 0016
                 "sample_prompts": "JSON", "promoted_step": "INTEGER"}  # 0017


def add_later_columns(path: Path) -> None:
    have = {row[1] for row in sql(path, "PRAGMA table_info(jobs)")}
    for name, kind in LATER_COLUMNS.items():
        if name not in have:
            sql(path, f"ALTER TABLE jobs ADD COLUMN {name} {kind}")

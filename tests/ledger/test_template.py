"""The tests' migrated ledger is a copy of one ledger migrated once per test process (tests/helpers/ledger.py):
the copy must be the very ledger that migrating in place makes, or every test that uses it tests something else."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from lora_worker.ledger.migrate import current_revision, head_revision, upgrade
from tests.helpers.ledger import migrated_ledger


def _clauses(sql: str | None) -> list[str]:
    # A batch migration writes a table's CHECK constraints in an order that varies from run to run (alembic keeps
    # them in a set), so two ledgers migrated in place differ in it too: compare the clauses, not their order.
    return sorted(line.strip().rstrip(",").strip() for line in (sql or "").splitlines())


def _described(path: Path) -> tuple[list[tuple], str, list[tuple], int]:
    conn = sqlite3.connect(path)
    try:
        schema = [(kind, name, table, _clauses(sql)) for kind, name, table, sql
                  in conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name")]
        journal = conn.execute("PRAGMA journal_mode").fetchone()[0]
        sequences = conn.execute("SELECT name, seq FROM sqlite_sequence ORDER BY name").fetchall()
        rows = sum(conn.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0]
                   for kind, name, _, _ in schema if kind == "table" and not name.startswith("sqlite_"))
        return schema, journal, sequences, rows
    finally:
        conn.close()


def test_a_copied_ledger_is_the_ledger_migrating_in_place_makes(tmp_path):
    copied = migrated_ledger(tmp_path / "copied" / "ledger.sqlite3")
    upgrade(in_place := tmp_path / "in-place" / "ledger.sqlite3")
    assert current_revision(copied) == current_revision(in_place) == head_revision()
    assert _described(copied) == _described(in_place)


def test_each_copy_is_its_own_file(tmp_path):
    first, second = migrated_ledger(tmp_path / "a.sqlite3"), migrated_ledger(tmp_path / "b.sqlite3")
    conn = sqlite3.connect(first)
    with conn:
        conn.execute("CREATE TABLE scratch (x)")
    conn.close()
    assert "scratch" not in {name for _, name, _, _ in _described(second)[0]}
    assert "scratch" not in {name for _, name, _, _ in _described(migrated_ledger(tmp_path / "c.sqlite3"))[0]}

"""A damaged ledger is refused, by a start-up check whose cost does not grow with the file and by a full check
in `lora-worker migrate` and `lora-worker doctor`, which read every page."""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from lora_worker import create_app
from lora_worker.errors import LedgerCorrupt
from lora_worker.ledger.migrate import check_ledger, upgrade, verify_integrity, verify_structure
from lora_worker.ops import cli


def grow(path: Path, megabytes: int) -> None:
    """A history of `megabytes` in the main file (DELETE journal: a page damaged there is what SQLite reads)."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("CREATE TABLE history_filler (x)")
    conn.executemany("INSERT INTO history_filler VALUES (?)", [("x" * 1000,)] * (megabytes * 1000))
    conn.commit()
    conn.close()


def page_size(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA page_size").fetchone()[0]
    finally:
        conn.close()


def root_page(path: Path, table: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    finally:
        conn.close()


def damage(path: Path, page: int, offset: int = 0) -> None:
    """Random bytes over a 1-based page, from `offset` within it."""
    size = page_size(path)
    with path.open("r+b") as fh:
        fh.seek((page - 1) * size + offset)
        fh.write(os.urandom(size - offset))


def bytes_read(fn) -> int:
    """What `fn` read through read()/pread() (this process's /proc rchar): SQLite reads pages that way."""
    def rchar() -> int:
        return next(int(line.split()[1]) for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:"))
    before = rchar()
    fn()
    return rchar() - before


def test_the_start_up_check_reads_a_bounded_part_of_a_large_ledger(migrated):
    path = migrated.database_path
    grow(path, 30)
    assert path.stat().st_size > 30e6
    assert bytes_read(lambda: check_ledger(migrated)) < 1e6
    assert bytes_read(lambda: verify_integrity(path)) > 30e6  # the full check does read it all


def test_a_damaged_schema_page_is_caught_at_start_up(migrated):
    path = migrated.database_path
    grow(path, 2)
    damage(path, 1, offset=100)  # the schema's b-tree, behind the 100-byte file header
    with pytest.raises(LedgerCorrupt):
        verify_structure(path)
    with pytest.raises(LedgerCorrupt):
        create_app(migrated)


@pytest.mark.parametrize("table", ["job_counts", "alembic_version"])
def test_a_damaged_page_of_a_small_table_is_caught_at_start_up(migrated, table):
    path = migrated.database_path
    grow(path, 2)
    damage(path, root_page(path, table))
    with pytest.raises(LedgerCorrupt):
        create_app(migrated)


def test_a_damaged_history_page_is_caught_by_migrate_and_doctor(migrated, capsys, monkeypatch):
    path = migrated.database_path
    grow(path, 2)
    damage(path, root_page(path, "history_filler") + 200)
    before = path.read_bytes()
    with pytest.raises(LedgerCorrupt):
        upgrade(path)
    monkeypatch.setattr(cli, "load_settings", lambda: migrated)
    assert cli.main(["migrate"]) == 1
    assert "ledger" in capsys.readouterr().err
    assert cli.main(["doctor"]) == 1
    assert "[FAIL] ledger:" in capsys.readouterr().out
    assert path.read_bytes() == before  # refused, never repaired or rewritten


# -- the schema the code needs, known without alembic --------------------------------------------------------

def test_the_head_revision_read_from_the_files_is_alembics():
    from alembic.script import ScriptDirectory

    from lora_worker.ledger.migrate import alembic_config, head_revision

    assert head_revision() == ScriptDirectory.from_config(alembic_config(Path("unused"))).get_current_head()


def test_migrations_with_two_heads_are_refused(tmp_path, monkeypatch):
    from lora_worker.errors import ConfigError
    from lora_worker.ledger import migrate

    (tmp_path / "versions").mkdir()
    for name, rev, down in (("a", "0001", "None"), ("b", "0002", '"0001"'), ("c", "0003", '"0001"')):
        (tmp_path / "versions" / f"{name}.py").write_text(f'revision: str = "{rev}"\ndown_revision = {down}\n')
    monkeypatch.setattr(migrate, "MIGRATIONS_DIR", tmp_path)
    with pytest.raises(ConfigError, match="2 heads"):
        migrate.head_revision()
    (tmp_path / "versions" / "d.py").write_text('revision = "0004"\ndown_revision = ("0002", "0003")\n')
    assert migrate.head_revision() == "0004"  # a merge revision joins them

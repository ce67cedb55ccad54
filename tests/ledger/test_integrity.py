"""A damaged ledger is refused: every start (a worker's, and `lora-worker migrate` at the code's schema) makes a
check whose cost does not grow with the file; the full check, every page, runs in `lora-worker check-ledger` (the
daily timer), `lora-worker doctor`, and `upgrade` before it applies a revision. Nothing repairs the file."""
from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pytest

from lora_worker import create_app
from lora_worker.errors import LedgerCorrupt
from lora_worker.ledger.migrate import (alembic_config, check_ledger, current_revision, head_revision, upgrade,
                                        verify_integrity, verify_structure)
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


# Random bytes over a page make SQLite either list what is wrong or refuse the file as malformed.
DAMAGE_FOUND = "(failed PRAGMA quick_check|is not a readable SQLite database)"


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


def test_migrate_at_the_codes_schema_reads_a_bounded_part_of_a_large_ledger(migrated, monkeypatch, capsys):
    # `lora-worker migrate` is the unit's ExecStartPre: it runs at every service start.
    path = migrated.database_path
    grow(path, 30)
    monkeypatch.setattr(cli, "load_settings", lambda: migrated)
    upgrade(path)  # alembic's first command in this process reads its own files; only the ledger is measured
    assert bytes_read(lambda: upgrade(path)) < 1e6
    assert bytes_read(lambda: cli.main(["migrate"])) < 1e6
    assert f"at schema {head_revision()}" in capsys.readouterr().out


def test_a_damaged_history_page_is_caught_by_check_ledger_and_doctor_and_left_as_it_was(migrated, capsys,
                                                                                         monkeypatch):
    path = migrated.database_path
    grow(path, 2)
    damage(path, root_page(path, "history_filler") + 200)
    before = path.read_bytes()
    monkeypatch.setattr(cli, "load_settings", lambda: migrated)
    assert cli.main(["check-ledger"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(rf"(?m)^lora-worker check-ledger: ledger {re.escape(str(path))} {DAMAGE_FOUND}", captured.err)
    assert "restore" in captured.err and "left as it is" in captured.err  # what to do, and that nothing was done
    assert cli.main(["doctor"]) == 1
    assert "[FAIL] ledger:" in capsys.readouterr().out
    assert path.read_bytes() == before  # refused, never repaired or rewritten


def test_an_upgrade_with_a_revision_to_apply_refuses_a_damaged_history_page(settings, capsys, monkeypatch):
    from alembic.script import ScriptDirectory

    path = settings.database_path
    older = ScriptDirectory.from_config(alembic_config(path)).get_revision(head_revision()).down_revision
    assert isinstance(older, str)
    upgrade(path, older)
    grow(path, 2)
    damage(path, root_page(path, "history_filler") + 200)
    before = path.read_bytes()
    with pytest.raises(LedgerCorrupt, match=DAMAGE_FOUND):
        upgrade(path)
    monkeypatch.setattr(cli, "load_settings", lambda: settings)
    assert cli.main(["migrate"]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"(?m)^lora-worker migrate: ledger {re.escape(str(path))} {DAMAGE_FOUND}", err), err
    assert path.read_bytes() == before  # never migrated: a migration would copy the damage into new tables
    assert current_revision(path) == older


def test_check_ledger_reads_every_page_and_says_ok_with_what_it_checked(migrated, capsys, monkeypatch):
    path = migrated.database_path
    grow(path, 2)
    before = path.read_bytes()
    monkeypatch.setattr(cli, "load_settings", lambda: migrated)
    assert bytes_read(lambda: cli.main(["check-ledger"])) > len(before)  # the whole file, not a bounded part
    out = capsys.readouterr().out
    assert re.fullmatch(rf"ledger {re.escape(str(path))}: ok \({len(before) / 1e6:.1f} MB checked in "
                        r"[0-9]+\.[0-9]{2} s\)\n", out), out
    assert path.read_bytes() == before  # read-only


def test_check_ledger_without_a_ledger_fails_and_creates_none(settings, capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_settings", lambda: settings)
    assert cli.main(["check-ledger"]) == 1
    assert f"No ledger at {settings.database_path}" in capsys.readouterr().err
    assert not settings.database_path.exists()


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

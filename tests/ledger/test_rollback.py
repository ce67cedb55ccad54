"""A rollback: code older than the ledger refuses to start (migrate, and every command that reads the ledger) in
one line that names both schema revisions and the command that downgrades; the newer code's `migrate --to`
takes the ledger down, after which the older code runs. "The older code" is this code with migrations/ as the
previous release had it (without the newest revision), so the test needs no git history. (Its models are still
this code's, so past the schema checks the "older code" is not run further than `migrate`.)"""
from __future__ import annotations

import pytest

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from lora_worker.ledger.migrate import MIGRATIONS_DIR, current_revision, head_revision
from tests.helpers.service import settings_env

pytestmark = pytest.mark.slow  # every test here starts real processes

# The previous release: the same package, its migrations one revision short.
OLDER_CODE = ("import sys; from pathlib import Path; import lora_worker.ledger.migrate as m; "
              "m.MIGRATIONS_DIR = Path(sys.argv[1]); from lora_worker.ops.cli import main; "
              "sys.exit(main(sys.argv[2:]))")


def previous_migrations(tmp_path: Path) -> tuple[Path, str]:
    """A copy of migrations/ without the head revision's file, and that copy's head."""
    head = head_revision()
    copy = tmp_path / "previous-migrations"
    shutil.copytree(MIGRATIONS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (newest,) = [p for p in (copy / "versions").glob("*.py") if f'revision: str = "{head}"' in p.read_text()
                 or f'revision = "{head}"' in p.read_text()]
    (parent,) = re.findall(r"^down_revision\b[^=\n]*=\s*\W(\w+)\W", newest.read_text(), re.M)
    newest.unlink()
    return copy, parent


def newer(settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "lora-worker"), *argv], capture_output=True, text=True,
                          env={**os.environ, **settings_env(settings)}, timeout=120)


def older(settings, migrations: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", OLDER_CODE, str(migrations), *argv], capture_output=True, text=True,
                          env={**os.environ, **settings_env(settings)}, timeout=120)


def test_older_code_on_a_newer_ledger_refuses_in_one_line_and_the_newer_code_takes_it_down(settings, tmp_path):
    migrations, previous = previous_migrations(tmp_path)
    head = head_revision()
    assert newer(settings, "migrate").returncode == 0
    assert current_revision(settings.database_path) == head

    for argv in (["migrate"], ["jobs", "ls"], ["reconcile"]):
        refused = older(settings, migrations, *argv)
        assert refused.returncode == 1 and refused.stdout == "", refused.stdout
        (line,) = refused.stderr.splitlines()  # one line, no traceback
        assert f"at schema {head}, newer than this code's {previous}" in line, line
        assert f"`lora-worker migrate --to {previous}`" in line, line
    assert current_revision(settings.database_path) == head  # refused: not touched

    down = newer(settings, "migrate", "--to", previous)
    assert down.returncode == 0, down.stderr
    assert current_revision(settings.database_path) == previous
    started = older(settings, migrations, "migrate")  # the rolled-back code's start (its ExecStartPre) passes
    assert started.returncode == 0 and f"at schema {previous}" in started.stdout, started.stderr
    assert newer(settings, "migrate").returncode == 0  # and rolling forward again is a plain migrate
    assert current_revision(settings.database_path) == head


def test_migrate_to_an_unknown_revision_is_refused_in_one_line(settings):
    result = newer(settings, "migrate", "--to", "9999")
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert "No schema revision '9999'" in line

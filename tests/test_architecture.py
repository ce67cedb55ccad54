"""The tree is the architecture: the import contracts in setup.cfg hold, and the processes that run for hours
next to the trainer (the supervisor) or in an operator's shell (`lora-worker jobs …`) load no web framework."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lora_worker.config import REPO_ROOT, Settings
from tests.helpers.service import settings_env

pytestmark = pytest.mark.slow  # every test here starts a real process

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
WEB_STACK = {"flask", "werkzeug", "marshmallow", "apispec", "apispec_webframeworks", "prometheus_client"}


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_import_contracts_in_setup_cfg_hold():
    result = _lint_imports(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _lint_a_copy_with(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """The same contracts over a copy of the package in which `module` (a path under lora_worker/) gains `line`."""
    shutil.copytree(REPO_ROOT / "lora_worker", tmp_path / "lora_worker",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "setup.cfg", tmp_path / "setup.cfg")
    source = tmp_path / "lora_worker" / module
    source.write_text(source.read_text() + f"\n{line}  # noqa\n")
    return _lint_imports(tmp_path, pythonpath=tmp_path)


def test_the_contracts_catch_a_ledger_that_reaches_into_the_host(tmp_path: Path):
    result = _lint_a_copy_with(tmp_path, "ledger/repository.py", "from lora_worker.host import processes")
    assert result.returncode != 0
    assert "The ledger is storage" in result.stdout and "BROKEN" in result.stdout


def test_the_contracts_catch_flask_below_the_web(tmp_path: Path):
    result = _lint_a_copy_with(tmp_path, "transcript/outcome.py", "import flask")
    assert result.returncode != 0
    assert "Nothing below the web loads a web framework BROKEN" in result.stdout


def test_lora_worker_jobs_ls_loads_no_web_framework(migrated: Settings):
    # The real command in a real process: `main(["jobs", "ls"])`, then what it had loaded.
    code = ("import json, sys\nfrom lora_worker.ops.cli import main\nrc = main(['jobs', 'ls'])\n"
            "print(json.dumps({'rc': rc, 'modules': sorted({m.split('.')[0] for m in sys.modules})}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, **settings_env(migrated)}, timeout=60)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0
    assert "sqlalchemy" in report["modules"]  # it did read the ledger
    assert not WEB_STACK & set(report["modules"])


# Where the Slurm backend's name may be written: its own package, the settings that name it, and the ledger's
# column definitions (migrations live outside the package). Anywhere else a `"slurm"` is a branch on the
# backend's name that belongs behind backends.py's seam.
SLURM_NAME_ALLOWED = ("slurm/", "config.py", "config_", "ledger/models.py")  # config_*.py: the settings' modules


def _string_literals(tree: ast.AST) -> list[ast.Constant]:
    """Every str constant but docstrings (a statement that is only a string says something; it decides nothing)."""
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def test_no_slurm_literal_outside_the_slurm_package_the_config_and_the_ledgers_columns():
    package = REPO_ROOT / "lora_worker"
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where.startswith(SLURM_NAME_ALLOWED):
            continue
        found += [f"{where}:{node.lineno}" for node in _string_literals(ast.parse(path.read_text()))
                  if node.value.strip().lower() == "slurm"]
    assert found == []


def test_the_slurm_literal_scan_sees_code_and_skips_comments_and_docstrings():
    tree = ast.parse('"""A docstring naming "slurm"."""\n# "slurm" in a comment\nif backend == "slurm":\n    pass\n')
    assert [node.value for node in _string_literals(tree)] == ["slurm"]


def test_the_contracts_catch_sqlalchemy_in_the_transcript(tmp_path: Path):
    result = _lint_a_copy_with(tmp_path, "transcript/outcome.py", "import sqlalchemy")
    assert result.returncode != 0
    assert "never load SQLAlchemy" in result.stdout and "BROKEN" in result.stdout


def test_the_contracts_catch_the_local_run_reaching_into_slurm(tmp_path: Path):
    result = _lint_a_copy_with(tmp_path, "run/runner.py", "from lora_worker.slurm import states")
    assert result.returncode != 0
    assert "neither imports the other BROKEN" in result.stdout.replace("\n", " ")

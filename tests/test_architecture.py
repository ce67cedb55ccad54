"""The tree is the architecture: the import contracts in setup.cfg hold, and the processes that run for hours
next to the trainer (the supervisor) or in an operator's shell (`lora-worker jobs …`) load no web framework."""
from __future__ import annotations

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

"""The suite's own layout: a test module is never imported (what tests share lives in tests/helpers/ or a
conftest), and its folders mirror the package, plus the few that test something other than a package."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
PACKAGE = TESTS.parent / "lora_worker"
# Folders of tests that are not a package of lora_worker/, each for what it tests.
NOT_A_PACKAGE = {
    "chaos": "faults injected across the whole worker",
    "contract": "the life of a job, one contract proven on every backend",
    "cluster": "the real single-node Slurm cluster (tests/cluster/cluster.py)",
    "deploy": "systemd/, deploy/ and the Makefile",
    "helpers": "what the tests share (no tests)",
    "fakes": "the fake trainer, a program (no tests)",
    "data": "captures of real runs (no tests)",
    "rig": "the real sd-scripts on the CPU rig (opt-in: LW_RIG_DIR)",
}


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of every module an import statement names, its `from` names included (one may be a
    module: `from tests.ops import test_jobs`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found += [(node.lineno, module)] + [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def _offences(source: str, where: str) -> list[str]:
    offences = []
    for line, name in _imported(ast.parse(source)):
        last = name.rsplit(".", 1)[-1]
        if name.startswith(("tests.", ".")) and (last.startswith("test_") or last == "conftest"):
            offences.append(f"{where}:{line} imports {name}")
    return offences


def test_no_module_imports_a_test_module_or_a_conftest():
    offences = []
    for path in sorted(TESTS.rglob("*.py")) + sorted((TESTS.parent / "bench").rglob("*.py")):
        offences += _offences(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not offences, ("what tests share goes in tests/helpers/ (a package) or a conftest's fixtures, never "
                          "in a test module:\n" + "\n".join(offences))


def test_the_scan_sees_each_form_of_import():
    for source in ("from tests.ops.test_jobs import jobs", "import tests.ops.test_jobs",
                   "from tests.ops import test_jobs", "def f():\n    from tests.slurm.conftest import SlurmWorker",
                   "import tests.slurm.conftest as c",
                   "from .test_supervisor import submit"):
        assert _offences(source, "x"), source
    for source in ("from tests.helpers import wait_for", "from tests.helpers.ledger import columns",
                   "import pytest", "from tests.cluster.cluster import Cluster"):
        assert not _offences(source, "x"), source


def test_the_test_folders_mirror_the_package():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - packages <= set(NOT_A_PACKAGE), f"a test folder neither a package nor listed: {folders - packages}"
    with_tests = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert not with_tests & {"helpers", "fakes", "data"}


"""No decision by a backend's name: outside slurm/ (and run/local.py, the local backend itself), the settings' checks
and `backends.named` (where a name becomes a backend), nothing compares a value with "local", "slurm" or slurm.NAME.
What differs between the backends is asked of the row's backend object (backends.py's seam), chosen per row by
`backend_of(job)` or, for new jobs, by `backend_for(settings)`."""
from __future__ import annotations

import ast
from pathlib import Path

from lora_worker.config import BACKENDS

PACKAGE = Path(__file__).resolve().parent.parent / "lora_worker"
# Where a backend's name may be compared: the backends themselves, the settings' validation, and the one place a
# name (the row's column, the setting) becomes a backend object.
ALLOWED = {"config_settings.py": "Settings.__post_init__", "backends.py": "named"}


def _names_a_backend(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in BACKENDS:
        return True
    return isinstance(node, ast.Attribute) and node.attr == "NAME" or isinstance(node, ast.Name) and node.id == "NAME"


def comparisons(source: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of each comparison with a backend's name ("local", "slurm", NAME)."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Compare) and any(_names_a_backend(n) for n in [child.left, *child.comparators]):
                found.append((child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(source), "")
    return found


def test_the_scan_sees_a_comparison_with_a_backends_name():
    assert comparisons('def f(job):\n    return job.backend == "slurm"') == [(2, "f")]
    assert comparisons("def g(s):\n    if s.backend != slurm.NAME:\n        pass") == [(2, "g")]
    assert comparisons('x = "local" in (a, b)') == [(1, "")]
    assert comparisons("def h(job, backend):\n    return job.backend == backend.name") == []


def test_no_decision_by_a_backends_name_outside_the_backends_and_the_settings_checks():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("slurm/") or relative == "run/local.py":
            continue
        for line, where in comparisons(path.read_text()):
            allowed = ALLOWED.get(relative)
            if allowed is None or not where.startswith(allowed):
                offences.append(f"lora_worker/{relative}:{line} ({where or 'module'})")
    assert offences == [], ("ask the row's backend (backends.backend_of) instead of comparing its name: "
                            + ", ".join(offences))

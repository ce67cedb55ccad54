"""docs/layout.md draws the tree as it is: it names every package under lora_worker/ (a nested one by its name in
its parent's line), every module beside them, and every migration in migrations/versions/."""
from __future__ import annotations

import re

from lora_worker.config import REPO_ROOT

PACKAGE = REPO_ROOT / "lora_worker"


def drawing() -> str:
    """The tree as docs/layout.md draws it (its code block)."""
    return (REPO_ROOT / "docs" / "layout.md").read_text().split("```", 2)[1]


def missing_packages(tree: str) -> list[str]:
    found = sorted(p.parent.relative_to(PACKAGE) for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    assert found
    return ([str(p) for p in found if len(p.parts) == 1 and not re.search(rf"^(lora_worker/)?\s*{p}/ ", tree, re.M)]
            + [str(p) for p in found if len(p.parts) > 1 and not re.search(rf"\b{p.name}\b", tree)])


def missing_modules(tree: str) -> list[str]:
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert modules
    return [m for m in modules if not re.search(rf"\b{m}\b", tree)]


def missing_migrations(tree: str) -> list[str]:
    line = tree.split("\nmigrations/", 1)[1].split("\nsystemd/", 1)[0]
    numbers = sorted(p.name[:4] for p in (REPO_ROOT / "migrations" / "versions").glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert numbers
    named = set(re.findall(r"\b(\d{4})\b", line))
    for low, high in re.findall(r"\b(\d{4})-(\d{4})\b", line):  # a range, 0004-0005
        named |= {f"{n:04d}" for n in range(int(low), int(high) + 1)}
    return [n for n in numbers if n not in named]


def test_every_package_module_and_migration_is_named():
    tree = drawing()
    assert (missing_packages(tree), missing_modules(tree), missing_migrations(tree)) == ([], [], [])


def test_a_package_module_or_migration_left_out_is_found():
    tree = drawing()
    assert missing_packages(tree.replace("               ledger/", "               storage/")) == ["ledger"]
    assert missing_packages(tree.replace("schemas", "shapes")) == ["web/schemas"]
    assert missing_modules(tree.replace("reconcile.py", "policy.py")) == ["reconcile"]
    assert missing_migrations(tree.replace("0013", "00l3")) == ["0013"]
    assert missing_migrations(tree.replace("0004-0005", "0004")) == ["0005"]

"""The staged install, made once per module of tests/deploy that asks for it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.deploy import install, snapshot


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> tuple[Path, str, str, dict]:
    """One root installed twice: (root, first output, second output, snapshot after the first)."""
    root = tmp_path_factory.mktemp("stage") / "root"
    root.mkdir()
    first = install(root).stdout
    after_first = snapshot(root)
    second = install(root).stdout
    return root, first, second, after_first

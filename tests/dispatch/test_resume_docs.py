"""docs/errors.md's Resume refusals table is the catalogue (errors.RESUME_REASONS), word for word."""
from __future__ import annotations

import re

from lora_worker.config import REPO_ROOT
from lora_worker.errors import RESUME_REASONS


def test_the_resume_refusals_table_is_the_catalogue():
    text = (REPO_ROOT / "docs" / "errors.md").read_text()
    section = text.split("## Resume refusals", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.+) \|$", section, re.M))
    assert rows == RESUME_REASONS


def test_the_readme_and_docs_describe_resume():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "/train/<id>/resume" in readme and "docs/resume.md" in readme
    assert "auto_resume" in (REPO_ROOT / "docs" / "configuration.md").read_text()

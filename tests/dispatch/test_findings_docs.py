"""docs/errors.md's Dataset findings table is the catalogue (lora_worker/findings.py FINDINGS), word for word, and
every code the dataset checks say is in it, and no other."""
from __future__ import annotations

import re

from lora_worker.config import REPO_ROOT
from lora_worker.findings import FINDINGS


def test_the_dataset_findings_table_is_the_catalogue():
    text = (REPO_ROOT / "docs" / "errors.md").read_text()
    section = text.split("## Dataset findings", 1)[1].split("\n## ", 1)[0]
    rows = {code: (severity, meaning) for code, severity, meaning
            in re.findall(r"^\| `([a-z_0-9]+)` \| (error|warning) \| (.+) \|$", section, re.M)}
    assert rows == FINDINGS


def test_every_code_the_checks_say_is_catalogued():
    said = set()
    for module in ("dispatch/dataset.py", "dispatch/lint.py"):
        said |= set(re.findall(r'Finding\(\s*"([a-z_0-9]+)"', (REPO_ROOT / "lora_worker" / module).read_text()))
    assert said == set(FINDINGS), (said - set(FINDINGS), set(FINDINGS) - said)  # none unknown, none never said

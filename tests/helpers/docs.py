"""The documentation read as data: the tables the tests hold to the code."""
from __future__ import annotations

import re

from lora_worker.config import REPO_ROOT


def errors_doc_table() -> list[dict[str, object]]:
    """The rows of docs/errors.md's 'Status codes and errors' table."""
    text = (REPO_ROOT / "docs" / "errors.md").read_text()
    section = text.split("## Status codes and errors", 1)[1]
    rows = []
    for line in section.splitlines():
        if not re.match(r"^\| \d{3} \|", line):
            if rows:
                break
            continue
        status, error, retryable, retry_after, advice = [cell.strip() for cell in line.strip("|").split(" | ")]
        rows.append({"status": int(status), "error": error.strip("`"), "retryable": retryable == "yes",
                     "retry_after": "" if retry_after == "—" else retry_after, "advice": advice})
    return rows


def failure_classes_doc_table() -> list[tuple[str, bool]]:
    """(failure_class, retryable) of each row of docs/errors.md's 'Failure classes' table, in its order."""
    text = (REPO_ROOT / "docs" / "errors.md").read_text()
    section = text.split("## Failure classes", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), {"yes": True, "no": False}[cells[1]]))
    return rows

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

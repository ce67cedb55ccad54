"""docs/errors.md's Promote refusals table is the catalogue (errors.PROMOTE_REASONS), word for word; the docs
describe the samples, the routes and the events."""
from __future__ import annotations

import re

from lora_worker.config import REPO_ROOT, WEBHOOK_EVENT_TYPES
from lora_worker.errors import PROMOTE_REASONS


def test_the_promote_refusals_table_is_the_catalogue():
    text = (REPO_ROOT / "docs" / "errors.md").read_text()
    section = text.split("## Promote refusals", 1)[1].split("\n## ", 1)[0]
    assert dict(re.findall(r"^\| `([a-z_]+)` \| (.+) \|$", section, re.M)) == PROMOTE_REASONS


def test_the_docs_describe_the_samples_their_routes_and_events():
    samples = (REPO_ROOT / "docs" / "samples.md").read_text()
    for route in ("GET /train/<id>/samples", "GET /train/<id>/samples/<name>", "GET /train/<id>/samples.png",
                  "POST /train/<id>/promote"):
        assert route in samples, route
    assert "samples-rig-sheet.png" in samples and (REPO_ROOT / "docs" / "samples-rig-sheet.png").is_file()
    webhooks = (REPO_ROOT / "docs" / "webhooks.md").read_text()
    assert {"job.sample", "job.promoted"} <= set(WEBHOOK_EVENT_TYPES)
    assert "job.sample" in webhooks and "job.promoted" in webhooks
    assert "docs/samples.md" in (REPO_ROOT / "README.md").read_text()

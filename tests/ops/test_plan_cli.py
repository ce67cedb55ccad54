"""`lora-worker plan` (a dry run through the service's API) and `jobs show`'s lint: what an operator reads."""
from __future__ import annotations

import io
import json

from lora_worker.ops import plan as plan_cli
from lora_worker.ops.cli import build_parser
from tests.helpers.cli import jobs
from tests.helpers import job_rows


def through_the_test_client(api, calls):
    def post(url, token, body):
        calls.append(url)
        answer = api.post(url.split("127.0.0.1:8203", 1)[1], json=body)
        return answer.status_code, answer.get_json()
    return post


def test_plan_prints_the_plan_and_starts_nothing(api, host, monkeypatch, tmp_path):
    calls: list[str] = []
    monkeypatch.setattr(plan_cli, "post", through_the_test_client(api, calls))
    request = tmp_path / "request.json"
    request.write_text(json.dumps(host.payload()))
    out = io.StringIO()
    code = plan_cli.run(host.settings, build_parser().parse_args(["plan", str(request)]), out)
    text = out.getvalue()
    assert code == 0 and calls == ["http://127.0.0.1:8203/train?dry_run=1"] and job_rows(host.settings) == 0
    assert ("dataset:        3 images x 267 repeats = 801, batch 2: 401 steps per epoch, 1 epoch(s) for 400 "
            "steps (the folder's 10 repeats shown as 267: one epoch holds every step)\n") in text
    assert "\n  class_tokens = 'ohwx woman'\n  num_repeats = 267\n" in text
    assert "states:         100 (resumable), 200 (resumable), 300 (resumable), 400 (not resumable)\n" in text
    assert "  bucket 0: resolution (64, 64), count: 801\n  mean ar error (without repeats): 0.0\n" in text
    assert "duration:       70 min (at most: the tier's bound, no finished job like it yet)\n" in text
    assert "warning image_small: 10_ohwx woman/img0.png:" in text and text.startswith("command:        ")
    out = io.StringIO()
    assert plan_cli.run(host.settings, build_parser().parse_args(["plan", str(request), "--json"]), out) == 0
    assert json.loads(out.getvalue())["dry_run"] is True


def test_plan_of_a_refused_request_prints_every_finding_and_exits_1(api, host, monkeypatch, tmp_path):
    monkeypatch.setattr(plan_cli, "post", through_the_test_client(api, []))
    (host.dataset / "10_ohwx woman" / "img1.txt").write_bytes(b"")
    request = tmp_path / "request.json"
    request.write_text(json.dumps(host.payload()))
    out = io.StringIO()
    assert plan_cli.run(host.settings, build_parser().parse_args(["plan", str(request)]), out) == 1
    assert out.getvalue().startswith("refused: 422 dataset_invalid: ")
    assert "  error caption_empty: 10_ohwx woman/img1.txt: caption is empty" in out.getvalue()


def test_jobs_show_prints_the_lint_of_the_job(api, host, migrated):
    accepted = api.post("/train", json=host.payload()).get_json()
    code, out = jobs(migrated, "show", str(accepted["worker_job_id"]))
    assert code == 0
    lint = out.split("lint: ", 1)[1].split("events:\n", 1)[0]
    assert lint.startswith(f"{len(accepted['warnings'])} warning(s) of the dataset at dispatch\n")
    assert "  image_duplicate: 10_ohwx woman/img1.png: the same bytes as img0.png" in lint

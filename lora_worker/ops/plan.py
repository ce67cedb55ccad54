"""`lora-worker plan <request.json>`: a dry run of a POST /train body, through the running service (as `smoke` goes
through it), so that every check is the service's own: its plan, or every reason it would refuse the request.

It prints the plan a person reads (the command, the dataset as sd-scripts will count and bucket it, the states a
resume could use, the time and disk, the lint's warnings); `--json` prints the service's answer as it is.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TextIO

from lora_worker.config import Settings
from lora_worker.errors import ConfigError
from lora_worker.ops.smoke import api_token

TIMEOUT_S = 300.0  # the lint decodes at most 60 s (dispatch/lint.py DECODE_SECONDS); the rest is reading


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plan = sub.add_parser("plan", help="dry-run a POST /train body on the running service: its plan, or its refusal")
    plan.add_argument("request", help="the JSON body of POST /train (`-`: read it from stdin)")
    plan.add_argument("--url", default=None, help="the service (default: http://<the `bind` setting>)")
    plan.add_argument("--token-file", default=None, help="the API token (default: the service's own)")
    plan.add_argument("--json", action="store_true", help="print the service's answer as it is")


def run(settings: Settings, args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    body = _body(args.request)
    url = (args.url or f"http://{settings.bind.split(',')[0].strip()}").rstrip("/")
    status, answer = post(url + "/train?dry_run=1", api_token(settings, args.token_file), body)
    if args.json:
        out.write(json.dumps(answer, indent=2, ensure_ascii=False) + "\n")
    elif status == 200:
        out.write(describe(answer))
    else:
        out.write(refusal(status, answer))
    return 0 if status == 200 else 1


def _body(source: str) -> Any:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
        return json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: not a readable JSON body ({exc})") from exc


def post(url: str, token: str | None, body: Any) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 - the operator's service
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(f"the service at {url} cannot be reached: {exc}") from exc


def describe(plan: dict[str, Any]) -> str:
    data, estimate = plan["dataset"], plan["estimated_duration"]
    states = ", ".join(f"{s['step']} ({'resumable' if s['resumable'] else 'not resumable'})" for s in data["states"])
    basis = (f"the median of {estimate['jobs']} finished job(s) like it" if estimate["basis"] == "history"
             else "at most: the tier's bound, no finished job like it yet")
    lines = [
        f"command:        {shlex.join(plan['argv'])}",
        f"dataset:        {data['images']} images x {data['repeats']} repeats = {data['images_x_repeats']}, "
        f"batch {data['batch_size']}: {data['steps_per_epoch']} steps per epoch, {data['epochs']} epoch(s) "
        f"for {data['max_train_steps']} steps (the folder's {data['folder_repeats']} repeats shown as "
        f"{data['repeats']}: one epoch holds every step)",
        f"dataset config: {data['dataset_config']['path']}",
        *(f"  {line}" for line in data["dataset_config"]["toml"].splitlines() if line),
        f"states:         {states or 'none'}",
        f"duration:       {estimate['seconds'] / 60:.0f} min ({basis})",
        f"disk at peak:   {plan['disk_mib_at_peak']} MiB",
        "buckets (as sd-scripts will print them):", *(f"  {line}" for line in data["bucket_table"]["lines"]),
        f"lint:           {plan['lint']['images_decoded']} image(s) decoded in {plan['lint']['seconds']} s, "
        f"{len(plan['lint']['warnings'])} warning(s)",
        *findings(plan["lint"]["warnings"]),
    ]
    return "\n".join(lines) + "\n"


def findings(found: list[dict[str, Any]], indent: str = "  ") -> list[str]:
    return [f"{indent}{f['severity']} {f['code']}: {f['file']}: {f['message']}" for f in found]


def refusal(status: int, answer: dict[str, Any]) -> str:
    lines = [f"refused: {status} {answer.get('error', '')}: {answer.get('message', '')}"]
    lines += findings((answer.get("details") or {}).get("findings") or [])
    return "\n".join(lines) + "\n"

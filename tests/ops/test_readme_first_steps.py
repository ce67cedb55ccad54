"""The README's opening and "First steps" sections, as a newcomer runs them in a fresh checkout: every command
that invokes the CLI is spelled the way it works there (`.venv/bin/lora-worker`), each such command runs (no
"command not found", no usage error, no traceback), and each `make` line is a target that exists. The curl lines
need a live service and a dataset under /worktank; they are left to tests/ops/test_demo.py's flow."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest

from lora_worker.config import REPO_ROOT

README = REPO_ROOT / "README.md"
BARE_CLI = re.compile(r"(?:^|[\s`(=])lora-worker (?=[a-z])")  # `lora-worker doctor`, not `.venv/bin/lora-worker …`


def first_steps() -> str:
    text = README.read_text()
    return text[:text.index("\n## What it does")]


def commands(text: str) -> list[str]:
    """Each shell command: the lines of ```sh blocks (continuations joined, comments dropped) and the inline
    code spans that are commands."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += ("\n" if pending else "") + line
            try:
                shlex.split(pending)
            except ValueError:
                continue  # a quoted string (a JSON body) goes on over the next line
            command, pending = re.sub(r"\s+#\s.*$", "", pending).strip(), ""
            if command and not command.startswith("#"):
                found.append(command)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    found += [s for s in spans if re.match(r"(\.venv/bin/lora-worker |lora-worker |make |[A-Z_]+=\S+ )", s)]
    return found


def test_every_cli_command_of_the_first_steps_is_spelled_as_it_works_in_a_checkout():
    cli = [c for c in commands(first_steps()) if "lora-worker" in c]
    assert cli, "no CLI command found: the parser no longer matches the README"
    bare = [c for c in cli if BARE_CLI.search(" " + c)]
    assert bare == [], f"these only work with the venv on PATH; write .venv/bin/lora-worker: {bare}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_first_steps_commands_run_in_a_fresh_checkout(tmp_path):
    checkout = tmp_path / "checkout"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    for rel in filter(None, tracked.stdout.split("\0")):
        if (REPO_ROOT / rel).is_file():
            (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, checkout / rel)
    (checkout / ".venv").symlink_to(REPO_ROOT / ".venv")  # what `make install` would have made
    (toml,) = re.findall(r"```toml\n# worker.toml\n(.*?)```", first_steps(), re.S)
    (checkout / "worker.toml").write_text(toml)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LORA_WORKER_") and k not in ("INVOCATION_ID", "CREDENTIALS_DIRECTORY", "MAKEFLAGS")}
    ran = []
    for command in commands(first_steps()):
        if command.startswith("curl "):
            continue
        if re.match(r"(\S+=\S+ )*make ", command):
            command = re.sub(r"\bmake ", "make -n ", command, count=1)  # the recipe, not a 20-minute test run
        elif "lora-worker jobs watch" in command:
            command = command.replace("jobs watch", "jobs watch --help")  # it follows a job until it ends
        result = subprocess.run(command, shell=True, cwd=checkout, env=env, capture_output=True, text=True,
                                timeout=120)
        out = result.stdout + result.stderr
        assert result.returncode not in (2, 126, 127) and "Traceback" not in out, f"{command}: {out[-2000:]}"
        ran.append(command)
    assert any(".venv/bin/lora-worker config" in c for c in ran) and any("doctor" in c for c in ran), ran

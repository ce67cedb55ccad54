"""systemd/install.py leaves nothing for a start to compile (the unit's prefix is read-only), makes a token file
others can read private and says so, and its --dry-run prints every change it would make while making none."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import install_script
from tests.helpers.deploy import copy_of, install, snapshot

# An install builds a venv from the lock: past the suite's 120 s timeout on a loaded machine (tests/helpers/deploy.py).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PREFIX = Path("opt/lora-training-worker")
# What a supervisor imports, as the web starts it (run/local.py: `python -S -m lora_worker.run`, PYTHONPATH the
# package's parent), and what the unit's gunicorn imports (the app, with site: the venv's packages).
SUPERVISOR = "import lora_worker.run.__main__, lora_worker.run.main, lora_worker.slurm.__main__"
WEB = "import lora_worker.web.app, lora_worker.ops.cli, gunicorn.app.wsgiapp, gunicorn.workers.gthread"


def compiled_where(root: Path) -> list[Path]:
    venv = root / PREFIX / "venv"
    return [root / PREFIX / "lora_worker", *sorted((venv / "lib").glob("python3*/site-packages"))]


def byte_code(root: Path) -> dict[str, int]:
    """Every .pyc under the code and the venv, with its mtime: what a start would have written."""
    return {str(p): p.stat().st_mtime_ns for top in compiled_where(root) for p in top.rglob("*.pyc")}


def test_every_module_of_the_code_and_the_venv_has_current_byte_code(staged):  # noqa: F811
    root = staged[0]
    stale = install_script().bytecode.stale(compiled_where(root))
    assert stale == [], f"{len(stale)} module(s) without current byte code, e.g. {stale[:5]}"
    assert (root / PREFIX / "lora_worker/run/__pycache__").is_dir()


def test_a_supervisor_and_the_web_started_as_the_unit_starts_them_compile_nothing(staged):  # noqa: F811
    root = staged[0]
    python = root / PREFIX / "venv/bin/python"  # the unit's interpreter, with the unit's flags (none: no -O)
    before = byte_code(root)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE")}
    # Writable here, so a module compiled from source would leave its .pyc behind: under the unit's read-only
    # prefix it would be compiled again at every start instead.
    for flags, code, path in ((["-S"], SUPERVISOR, str(root / PREFIX)), ([], WEB, None)):
        run_env = env if path is None else {**env, "PYTHONPATH": path}
        result = subprocess.run([str(python), *flags, "-c", code], capture_output=True, text=True, env=run_env,
                                cwd=root / PREFIX)
        assert result.returncode == 0, result.stderr
    after = byte_code(root)
    written = sorted(set(after) - set(before)) + sorted(p for p in before if after.get(p) != before[p])
    assert written == [], f"{len(written)} module(s) compiled at start, e.g. {written[:5]}"


def test_a_token_file_others_can_read_is_made_private_and_said_so(staged, tmp_path):  # noqa: F811
    root = copy_of(staged[0], tmp_path)
    token = root / "etc/lora-worker/api_token"
    token.chmod(0o644)
    result = install(root)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    (warning,) = [line for line in result.stderr.splitlines() if "api_token" in line]
    assert warning.startswith("WARNING: /etc/lora-worker/api_token was readable by others") and "rotate" in warning


def test_a_dry_run_prints_every_change_and_makes_none(staged, tmp_path):  # noqa: F811
    root = copy_of(staged[0], tmp_path)
    code = root / PREFIX
    (code / "lora_worker/errors.py").write_text("tampered\n")
    (code / "lora_worker/stale_module.py").write_text("x = 1\n")
    (root / "etc/systemd/system/lora-worker.service").unlink()
    (root / "etc/lora-worker/worker.toml").unlink()
    (root / "etc/lora-worker/api_token").chmod(0o640)
    before = snapshot(root)
    dry = install(root, "--dry-run")
    assert snapshot(root) == before  # not one path, mode or byte changed
    would = [line.removeprefix("would: ") for line in dry.stdout.splitlines() if line.startswith("would: ")]
    assert set(would) == {
        f"wrote /{PREFIX}/lora_worker/errors.py", f"removed /{PREFIX}/lora_worker/stale_module.py",
        "compile the code's and the venv's byte code", "created /etc/lora-worker/worker.toml (mode 0640)",
        "mode 0600 on /etc/lora-worker/api_token", "wrote /etc/systemd/system/lora-worker.service"}, dry.stdout
    assert f"{len(would)} change(s) (dry run: none made)" in dry.stdout
    real = install(root)  # and the install then makes exactly as many
    assert f"{len(would)} change(s)\n" in real.stdout, real.stdout

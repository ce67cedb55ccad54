"""`make run` serves where the config's `bind` says, and installs only what serving needs; `make test` adds
the test extras."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lora_worker.config import REPO_ROOT
from tests.helpers.service import free_port, settings_env
from tests.helpers.deploy import recipe

pytestmark = [pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed"),
              pytest.mark.slow]  # every test here runs make


def gunicorn_line(lines: list[str]) -> str:
    (line,) = [line for line in lines if "/gunicorn " in line]
    return line


def test_make_run_installs_the_locked_runtime_only_and_make_test_adds_the_test_extras(tmp_path):
    run = recipe("run", tmp_path / "venv")
    installs = [line for line in run if "pip install" in line]
    assert any("--require-hashes" in line and "-r deploy/requirements.lock" in line for line in installs), installs
    assert not any("[test]" in line for line in run), run
    test = recipe("test", tmp_path / "venv")
    assert any("pip install" in line and "'.[test]'" in line for line in test), test
    assert any("--require-hashes" in line for line in test)  # the same locked runtime underneath



def test_make_test_lints_and_types_the_code_before_the_suite_and_runs_it_on_workers(tmp_path):
    test = recipe("test", tmp_path / "venv")
    steps = [i for i, line in enumerate(test) if "/ruff check" in line or "/mypy" in line or "-m pytest" in line]
    assert [test[i].split()[0].rsplit("/", 1)[-1] for i in steps] == ["ruff", "mypy", "python", "status=0;"], test
    # The real cluster's tests in one process of their own (never two clusters at once), in the background...
    assert "-m pytest -p no:cacheprovider tests/cluster >" in test[steps[2]] and test[steps[2]].count(" & ") == 1
    assert " -n " not in test[steps[2]]
    # ...beside the rest on the workers, and the recipe fails when either part fails.
    assert "-n 4 --dist loadgroup --ignore=tests/cluster || status=$?" in test[steps[3]]
    assert any(line.startswith("wait $cluster || status=$?") for line in test) and test[-1].endswith("exit $status")


def test_make_test_fast_leaves_out_the_slow_tests_and_refuses_a_process_in_the_rest(tmp_path):
    (line,) = [line for line in recipe("test-fast", tmp_path / "venv") if "-m pytest" in line]
    assert line.startswith("LW_TEST_FAST=1 ") and '-m "not slow"' in line
    assert "ruff" not in line and "mypy" not in line


def test_make_fuzz_runs_the_marked_property_tests_under_the_fuzz_profile_without_a_timeout(tmp_path):
    (line,) = [line for line in recipe("fuzz", tmp_path / "venv") if "-m pytest" in line]
    assert line.startswith("HYPOTHESIS_PROFILE=fuzz ") and " -m fuzz " in line and "--timeout=0" in line

def test_make_run_leaves_bind_to_the_settings_unless_bind_is_given(tmp_path):
    assert "--bind" not in gunicorn_line(recipe("run", tmp_path / "venv"))
    assert "--bind 10.1.2.3:9000" in gunicorn_line(recipe("run", tmp_path / "venv", BIND="10.1.2.3:9000"))


@pytest.mark.slow
def test_the_gunicorn_that_make_run_starts_listens_where_the_config_files_bind_says(migrated, tmp_path):
    port = free_port()
    config = tmp_path / "worker.toml"
    config.write_text(f'bind = "127.0.0.1:{port}"\n')
    env = {key: value for key, value in settings_env(migrated).items() if key != "LORA_WORKER_BIND"}
    env = {**os.environ, **env, "LORA_WORKER_CONFIG": str(config)}
    env.pop("LORA_WORKER_BIND", None)
    # The very line make would run, against this test's venv (sys.prefix) instead of ./.venv.
    line = gunicorn_line(recipe("run", Path(sys.prefix)))
    log = (tmp_path / "gunicorn.log").open("wb")
    proc = subprocess.Popen(["bash", "-c", line], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline, status = time.monotonic() + 30, None
        while time.monotonic() < deadline and status is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                    status = response.status
            except OSError:
                assert proc.poll() is None, (tmp_path / "gunicorn.log").read_text()
                time.sleep(0.2)
        assert status == 200, (tmp_path / "gunicorn.log").read_text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_make_bench_writes_every_row_to_var_bench_json(tmp_path):
    (line,) = [line for line in recipe("bench", tmp_path / "venv") if "-m bench" in line]
    assert line.endswith("-m bench --json var/bench.json")

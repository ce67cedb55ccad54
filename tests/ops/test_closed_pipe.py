"""Every `lora-worker` command whose reader went away (`lora-worker jobs ls | head -1`) ends as coreutils do:
killed by SIGPIPE, with nothing on stderr, instead of a BrokenPipeError traceback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from tests.helpers.ledger import columns
from tests.helpers.cli import finished, write_log
from tests.helpers.service import settings_env

pytestmark = pytest.mark.slow
LORA_WORKER = str(Path(sys.executable).parent / "lora-worker")


def run_into_closed_pipe(settings, *argv: str) -> subprocess.CompletedProcess[bytes]:
    # The read end is closed before the command starts: its first write fails, every time, whatever its speed.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([LORA_WORKER, *argv], stdout=write_end, stderr=subprocess.PIPE, timeout=120,
                              env={**os.environ, **settings_env(settings)})
    finally:
        os.close(write_end)


@pytest.fixture
def ledger(db, migrated):
    ended = finished(db, JobState.SUCCEEDED, days_ago=200)
    write_log(migrated, ended, [f"line {i}" for i in range(50)]).close()
    queued = repo.create_job(db, columns()).id
    return {"ended": str(ended), "queued": str(queued)}


@pytest.mark.parametrize("argv", [
    ("migrate",), ("reconcile",), ("doctor",), ("jobs", "ls"), ("jobs", "show", "{ended}"),
    ("jobs", "log", "{ended}"), ("jobs", "log", "-f", "{ended}"), ("jobs", "prune", "--dry-run"),
    ("jobs", "cancel", "{queued}"),
], ids=" ".join)
def test_a_command_writing_to_a_closed_pipe_exits_quietly_by_sigpipe(migrated, ledger, argv):
    # The queued row has no supervisor: on a loaded machine the command's own reconcile could take it for a launch
    # that never started (launch_grace_s, 30 s) before the cancel writes its line. Not this test's subject.
    settings = replace(migrated, launch_grace_s=3600.0)
    result = run_into_closed_pipe(settings, *(arg.format(**ledger) for arg in argv))
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr and "Exception ignored" not in stderr, stderr
    assert result.returncode == -signal.SIGPIPE, (result.returncode, stderr)


def test_with_a_reader_the_same_command_still_prints_and_exits_0(migrated, ledger):
    result = subprocess.run([LORA_WORKER, "jobs", "ls"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **settings_env(migrated)})
    assert result.returncode == 0 and ledger["ended"] in result.stdout, result.stderr


def test_head_of_jobs_ls_in_a_shell_pipeline_prints_one_line_and_no_traceback(migrated, db):
    for _ in range(300):  # more than a pipe buffer's worth of rows, so the writer is still writing when head exits
        finished(db, JobState.FAILED, days_ago=1)
    result = subprocess.run(f"set -o pipefail; {LORA_WORKER} jobs ls --limit 300 | head -1", shell=True,
                            executable="/bin/bash", capture_output=True, text=True, timeout=120,
                            env={**os.environ, **settings_env(migrated)})
    assert result.stdout.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.returncode in (0, 128 + signal.SIGPIPE)  # 141 when head exited before the last write

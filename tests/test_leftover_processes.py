"""tests/conftest.py fails a test that leaves a process behind: the processes it finds are the test's own, by its
tmp dir in their command line or in LORA_WORKER_SETTINGS, among those started while the test ran."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.processes import pids, processes_of, start_recorder

pytestmark = pytest.mark.slow  # every test here starts a real process

SLEEP = "import time; time.sleep(60)"


def test_a_process_naming_the_tmp_dir_in_its_command_line_or_its_settings_is_found_and_no_other(tmp_path):
    before = pids()
    by_argv = subprocess.Popen([sys.executable, "-c", SLEEP, str(tmp_path / "state")])
    by_settings = subprocess.Popen([sys.executable, "-c", SLEEP],
                                   env={**os.environ, "LORA_WORKER_SETTINGS": str(tmp_path / "worker.toml")})
    by_other_variable = subprocess.Popen([sys.executable, "-c", SLEEP],
                                         env={**os.environ, "SOMETHING_ELSE": str(tmp_path)})
    unrelated = subprocess.Popen([sys.executable, "-c", SLEEP])
    started = [by_argv, by_settings, by_other_variable, unrelated]
    try:
        found = {p.pid for p in processes_of(str(tmp_path), pids() - before)}
        assert found == {by_argv.pid, by_settings.pid}
        assert not processes_of(str(tmp_path), before)  # one that ran before the test is never the test's
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
    assert not processes_of(str(tmp_path), pids() - before)  # and an exited one is not left


def test_the_fast_runs_recorder_sees_subprocess_and_fork_and_lets_them_through(monkeypatch):
    started = start_recorder(monkeypatch)
    assert subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True).stdout == "ran\n"
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    assert started == ["subprocess", "os.fork"]

"""The processes a test starts can be stopped as a terminal stops them, however the suite itself was started
(tests/conftest.py pytest_configure): `make test` starts the cluster's part as a shell's background job."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # it starts a process

PROBE = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, " \
        "signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL)"


def test_a_child_of_the_suite_takes_ctrl_c_and_sigquit():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_the_suite_started_as_a_shells_background_job_still_passes_ctrl_c_on():
    # What `make test` does to the cluster's part: `pytest … &` in sh, which ignores SIGINT and SIGQUIT for it.
    script = f"{sys.executable} -m pytest -q -p no:cacheprovider -n 0 -k takes_ctrl_c {__file__} & wait $!"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]

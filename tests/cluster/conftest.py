"""The real single-node Slurm (tests/cluster/cluster.py), started once per test session for the tests here.

Where it cannot run (no root, or a program missing) every test here is skipped, naming what is missing, so
`pytest -ra` lists the reason: never a silent pass. CI sets LW_SLURM_TESTS=required (.ci/run
installs the packages first), and then a missing piece fails the session instead of skipping it.

At the end of the session the cluster is stopped and must leave nothing behind: no daemon, no slurmstepd, no
job process (looked for with pgrep by name, against what was running before the session, and by the
cluster's own directory in each process's command line and environment).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.cluster import DAEMONS, Cluster, alive, missing_programs

REQUIRED_ENV = "LW_SLURM_TESTS"


def _unavailable() -> str | None:
    missing = missing_programs()
    if missing:
        return ("the single-node Slurm needs " + ", ".join(missing) + " (apt-get install slurmctld slurmd "
                "slurm-client slurmdbd munge mariadb-server)")
    if os.geteuid() != 0:
        return "the single-node Slurm runs its daemons as root (SlurmUser=root); run the tests as root"
    if not Path("/sys/fs/cgroup").is_dir():
        return "the single-node Slurm needs a cgroup hierarchy at /sys/fs/cgroup (proctrack/cgroup)"
    return None


def _pgrep(name: str) -> set[int]:
    done = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True)
    return {int(pid) for pid in done.stdout.split() if alive(int(pid))}


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    reason = _unavailable()
    if reason is not None:
        if os.environ.get(REQUIRED_ENV) == "required":
            pytest.fail(f"{REQUIRED_ENV}=required, but {reason}", pytrace=False)
        pytest.skip(reason)
    before = {name: _pgrep(name) for name in (*DAEMONS, "slurmstepd")}
    root = Path(tempfile.mkdtemp(prefix="lw-slurm-", dir="/tmp"))  # munged wants every directory above open
    running = Cluster(root).start()
    try:
        yield running
    finally:
        running.stop()
        leaked = {name: sorted(_pgrep(name) - before[name]) for name in before}
        leaked = {name: pids for name, pids in leaked.items() if pids}
        stray = running.leftovers()
        if not leaked and not stray:
            shutil.rmtree(root, ignore_errors=True)
        assert not leaked and not stray, (f"the test cluster left processes behind: {leaked}, {stray}; "
                                          f"its logs are in {root}/log")

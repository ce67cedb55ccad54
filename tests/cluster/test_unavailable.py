"""Where Slurm cannot run, its tests are skipped naming what is missing, never passed silently; with
LW_SLURM_TESTS=required (CI, as root) they fail instead. Run as a pytest session of its own whose PATH holds no
Slurm: nothing here needs the cluster."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_worker.config import REPO_ROOT

pytestmark = pytest.mark.slow

WITHOUT_SLURM = "/nonexistent"  # no sbatch, squeue, … (the clients live in /usr/bin, never looked for elsewhere)


def session(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "LW_SLURM_TESTS"}
    environ.update(PATH=WITHOUT_SLURM, PYTHONPATH=str(REPO_ROOT), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/cluster/test_doctor.py::test_on_a_cluster_set_up_as_documented_every_slurm_check_passes"],
                          cwd=REPO_ROOT, env=environ, capture_output=True, text=True, timeout=300)


def test_without_slurm_the_tests_are_skipped_naming_what_is_missing(tmp_path: Path) -> None:
    done = session(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout and "passed" not in done.stdout, done.stdout
    assert "the single-node Slurm needs sbatch, squeue" in done.stdout and "apt-get install" in done.stdout


def test_when_ci_requires_slurm_its_absence_fails_the_tests(tmp_path: Path) -> None:
    done = session(tmp_path, LW_SLURM_TESTS="required")
    assert done.returncode != 0, done.stdout
    assert "LW_SLURM_TESTS=required, but the single-node Slurm needs sbatch" in done.stdout, done.stdout

"""doctor's node check: a node of the partition runs this worker's probe of the sandbox through srun, so a
node without bubblewrap (where every job would end launch_error) is said before a job is sent there."""
from __future__ import annotations

import pytest

import sys
from pathlib import Path

from lora_worker.ops.doctor_slurm import node_sandbox_check
from tests.helpers import Host

pytestmark = pytest.mark.slow  # every test here starts real processes

NO_BWRAP = ("import sys; from lora_worker.host import sandbox; sandbox.bwrap_executable = lambda: None; "
            "from lora_worker.run.node import main; sys.exit(main(['--probe', 'bwrap']))")


def fake_srun(bin_dir: Path, body: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "srun"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return bin_dir


def test_a_node_that_can_run_the_sandbox_passes(host: Host, tmp_path: Path):
    # The fake srun runs the probe here, as a node would: its options dropped, the command run.
    bins = fake_srun(tmp_path / "bin", 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"')
    settings = host.settings.with_overrides(backend="slurm", slurm_bin_dir=bins, sandbox="bwrap")
    check = node_sandbox_check(settings)
    assert check.ok, check.line()


def test_a_node_without_bubblewrap_fails_saying_how_to_fix_it(host: Host, tmp_path: Path):
    bins = fake_srun(tmp_path / "bin", f"exec {sys.executable} -c \"{NO_BWRAP}\"")
    settings = host.settings.with_overrides(backend="slurm", slurm_bin_dir=bins, sandbox="bwrap")
    check = node_sandbox_check(settings)
    assert not check.ok and check.required
    assert "not installed" in check.detail and "launch_error" in check.detail
    assert "apt-get install bubblewrap" in check.detail


def test_no_free_node_is_a_warning_not_a_failure(host: Host, tmp_path: Path):
    busy = "srun: error: Unable to allocate resources: Requested nodes are busy"
    bins = fake_srun(tmp_path / "bin", f"echo '{busy}' >&2; exit 1")
    check = node_sandbox_check(host.settings.with_overrides(backend="slurm", slurm_bin_dir=bins))
    assert not check.ok and not check.required

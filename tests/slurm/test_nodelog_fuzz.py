"""The Slurm node's small files are read totally: whatever bytes `<id>.rc` (the node's storage, another party's
too) and `job-<id>.node-offset` hold, the trainer's status is None or a return code a trainer can have, and the
offset a number `_save` could have written or 0. A node log shorter than the recorded offset is logged again from
its start (a restart may log some bytes twice, never lose any). The budget is the Hypothesis profile's
(tests/helpers/fuzz.py)."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import example, given, strategies as st

from lora_worker.slurm.nodelog import NodeLog, offset_path, saved_offset
from lora_worker.slurm.sbatch import log_path, rc_path
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.output import TrainerOutput

pytestmark = pytest.mark.fuzz

JOB = 7


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> SimpleNamespace:
    """What NodeLog reads of the settings: the worker's log dir and the node's."""
    root = tmp_path_factory.mktemp("nodelog")
    (root / "logs").mkdir()
    (root / "slurm").mkdir()
    return SimpleNamespace(log_dir=root / "logs", slurm_logs=root / "slurm")


def node_log(settings, tmp: Path) -> NodeLog:
    joblog = JobLog(tmp, JOB, head_bytes=1 << 16, tail_bytes=1 << 16)
    return NodeLog(settings, JOB, TrainerOutput(joblog, lambda phase, step: None))


numbers = st.integers(-10**30, 10**30).map(lambda n: str(n).encode())
contents = st.one_of(st.binary(max_size=80), numbers, numbers.map(lambda b: b + b"\n"),
                     st.sampled_from([b"", b"\n", b"0\n", b"-9\n", b"137\n", b"+1", b"1_0", b"\xd9\xa3", b"\xc2\xb2",
                                      b"9" * 5000, b" 12 \n", b"-0"]))


@given(contents)
@example(b"\xc2\xb2")  # "²": str.isdigit() says yes and int() says no: ValueError out of saved_offset
@example(b"\xff\n")  # not UTF-8: UnicodeDecodeError out of read_text
@example(b"9" * 100)  # a status of 100 digits, stored in an INTEGER column
def test_any_rc_file_is_a_status_or_none(settings, tmp_path_factory, data):
    rc_path(settings, JOB).write_bytes(data)
    reader = node_log(settings, tmp_path_factory.mktemp("log"))
    status = reader.recorded_status()
    reader.output.joblog.close()
    assert status is None or -127 <= status <= 255
    if re.fullmatch(rb"-?[0-9]{1,3}\n?", data) and -127 <= int(data) <= 255:
        assert status == int(data)  # what run/node.py writes (the return code and a newline) reads back


@given(contents)
@example(b"\xc2\xb2")
@example(b"\xff\n")
def test_any_offset_file_is_an_offset_or_zero(settings, data):
    offset_path(settings, JOB).write_bytes(data)
    offset = saved_offset(settings, JOB)
    assert offset >= 0
    if re.fullmatch(rb"[0-9]{1,18}\n?", data):
        assert offset == int(data)  # what NodeLog._save writes (the offset and a newline) reads back

class RecordingOutput:
    """A TrainerOutput's part NodeLog uses, recording what it is given and whether the run log was muted."""

    def __init__(self) -> None:
        self.joblog = SimpleNamespace(muted=False)
        self.fed: list[tuple[bytes, bool]] = []

    def consume(self, data: bytes, now: float) -> None:
        self.fed.append((data, self.joblog.muted))

    def tick(self, now: float) -> None:
        pass


@given(st.integers(0, 10**18), st.binary(min_size=1, max_size=200))
@example(10**12, b"a log shorter than its record\n")
def test_an_offset_past_the_log_is_logged_again_from_the_start(settings, offset, log):
    offset_path(settings, JOB).write_bytes(f"{offset}\n".encode())
    log_path(settings, JOB).write_bytes(log)
    output = RecordingOutput()
    reader = NodeLog(settings, JOB, output)  # type: ignore[arg-type]
    reader.pump(0.0)
    reader.close()
    assert b"".join(data for data, _ in output.fed) == log  # every byte parsed
    logged = b"".join(data for data, muted in output.fed if not muted)
    assert logged == (log if offset > len(log) else log[offset:])  # and the ones not logged before, logged
    assert saved_offset(settings, JOB) == len(log)

"""Every phase the trainer passes is kept, in order, however its output was cut: a capture fed as one read (what
a trainer without unbuffered output gives, or the Slurm poller's read of a whole cycle) passes the same phases
as the capture read chunk by chunk, and the ledger records each of them once."""
from __future__ import annotations

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.states import JobState, Phase
from lora_worker.transcript.parser import Parser
from tests.helpers.ledger import columns
from tests.helpers.captures import CAPTURES, stream

P = Phase
RUN1 = [P.LOADING_MODEL, P.CACHING_LATENTS, P.CACHING_TEXT_ENCODER_OUTPUTS, P.PREPARING_TRAINING, P.TRAINING, P.SAVING]


def phases(chunks: list[bytes]) -> list[Phase]:
    parser = Parser()
    for chunk in chunks:
        parser.feed(chunk)
    parser.close()
    return parser.progress.phases


def test_a_real_capture_fed_as_one_read_passes_every_phase():
    assert phases([stream("run1_simple")]) == RUN1  # the last one alone (`saving`) is all the phase column holds
    saves = phases([stream("run5_epochs_saves")])
    assert saves == RUN1[:-1] + [P.SAVING, P.TRAINING] * 3 + [P.SAVING]  # a mid-run save passes saving too


@pytest.mark.parametrize("name", CAPTURES)
def test_the_phases_are_the_same_in_one_read_and_byte_by_small_chunk(name):
    data = stream(name)
    assert phases([data]) == phases([data[i:i + 97] for i in range(0, len(data), 97)])


def test_the_ledger_records_each_phase_once_though_it_is_written_again_and_re_read(db):
    job = repo.create_job(db, columns())
    assert repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    passed = phases([stream("run1_simple")])
    assert repo.update_running(db, job.id, phases=passed[:2], phase=passed[1].value)  # two in one write
    assert repo.update_running(db, job.id, phases=passed, phase=passed[-1].value)
    assert repo.update_running(db, job.id, phases=passed, phase=passed[-1].value)  # nothing new: nothing added
    assert repo.update_running(db, job.id, phases=passed[:3], actor="slurm")  # a poller re-reading from the start
    recorded = [e.reason for e in repo.job_events(db, job.id) if e.from_status == e.to_status == "running"]
    assert recorded == [f"phase {p.value}" for p in RUN1]

"""Every failure class the code can write is one the ledger's CHECK accepts (migration 0006 added one)."""
from __future__ import annotations

import sqlite3

import pytest

from lora_worker.ledger import repository as repo
from alembic import command

from lora_worker.ledger.migrate import alembic_config
from lora_worker.states import FailureClass, JobState
from tests.helpers.ledger import columns


def store(path, job_id: int, value: str) -> None:
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute("UPDATE jobs SET failure_class=? WHERE id=?", (value, job_id))
    finally:
        conn.close()


@pytest.mark.parametrize("failure", list(FailureClass))
def test_every_failure_class_can_be_stored(db, failure):
    job = repo.create_job(db, columns())
    assert repo.transition(db, job.id, JobState.FAILED, actor="test", failure_class=failure.value)
    assert repo.get_job(db, job.id).failure_class == failure.value


def test_a_value_outside_the_enum_is_refused(db):
    job = repo.create_job(db, columns())
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        store(db.path, job.id, "tokenizer_broken")


def test_the_downgrade_keeps_a_tokenizer_invalid_row_as_a_crash(db):
    job = repo.create_job(db, columns())
    assert repo.transition(db, job.id, JobState.FAILED, actor="test", failure_class="tokenizer_invalid")
    db.dispose()
    command.downgrade(alembic_config(db.path), "0003")
    conn = sqlite3.connect(db.path)
    try:
        assert conn.execute("SELECT failure_class FROM jobs WHERE id=?", (job.id,)).fetchone() == ("trainer_crashed",)
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"), conn:
            conn.execute("UPDATE jobs SET failure_class='tokenizer_invalid' WHERE id=?", (job.id,))
    finally:
        conn.close()

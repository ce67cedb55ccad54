"""What a failure means for a new try is written once (states.RETRYABLE): GET /train/<id>, the webhook bodies
and docs/errors.md's Failure classes table all say its word, for every failure class."""
from __future__ import annotations

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.ledger.outbox import job_data
from lora_worker.states import RETRYABLE, FailureClass, JobState, retryable
from tests.helpers.docs import failure_classes_doc_table
from tests.helpers.ledger import columns


def test_every_failure_class_has_one_word_in_the_table():
    assert list(RETRYABLE) == list(FailureClass)


def test_the_docs_failure_classes_table_is_the_table_row_by_row():
    assert failure_classes_doc_table() == [(failure.value, word) for failure, word in RETRYABLE.items()]


def test_for_arbo_an_oom_may_pass_on_a_new_try_and_a_crash_of_the_trainer_may_not():
    """The 3090 shares its VRAM with TTS, whose use varies: an OOM depends on the moment. The trainer's own
    exception meets the same code and input again (docs/errors.md says why, beside the table)."""
    assert RETRYABLE[FailureClass.CUDA_OOM] is True
    assert RETRYABLE[FailureClass.TRAINER_CRASHED] is False


def test_only_a_failed_job_has_a_word_and_an_unknown_class_is_not_retried():
    assert retryable(JobState.SUCCEEDED.value, None) is None
    assert retryable(JobState.RUNNING.value, None) is None
    assert retryable(JobState.CANCELLED.value, None) is None
    assert retryable(JobState.FAILED.value, "a_class_of_a_newer_worker") is False


@pytest.mark.parametrize("failure", list(FailureClass))
def test_get_and_the_webhook_body_say_the_tables_word(failure, client, db):
    job = repo.create_job(db, columns())
    repo.fail_job(db, job.id, actor="api", failure_class=failure, sentence="it ended")
    shown = client.get(f"/train/{job.id}").get_json()
    assert (shown["failure_class"], shown["retryable"]) == (failure.value, RETRYABLE[failure])
    assert job_data({"id": job.id, "status": "failed", "failure_class": failure.value})["retryable"] \
        is RETRYABLE[failure]


def test_get_says_null_for_a_job_that_did_not_fail(client, db):
    job = repo.create_job(db, columns())
    assert client.get(f"/train/{job.id}").get_json()["retryable"] is None

"""Files in the state dir are not trusted: a link at logs/ or a FIFO where a run log was is refused at once (a
clean 503 `log_unreadable`), never waited on by a request thread; the cancel of a running job still succeeds."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from lora_worker.ledger import repository as repo
from lora_worker.transcript.logfile import append_note, log_paths
from lora_worker.states import FailureClass, JobState
from tests.helpers.ledger import columns
from tests.helpers.api import TOKEN, bearer
from tests.helpers.service import timed

READERS = 10  # more than gunicorn's 8 threads


@pytest.fixture
def finished_job(migrated, db) -> int:
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    repo.fail_job(db, job.id, actor="supervisor", failure_class=FailureClass.TRAINER_CRASHED, sentence="Crashed.",
                  log_lines=[])
    head, _ = log_paths(migrated.log_dir, job.id)
    head.parent.mkdir(parents=True, exist_ok=True)
    head.write_bytes(b"x" * 100 + b"\n")
    return job.id


def unblock(fifo: Path) -> None:
    """Open the FIFO's other end, so that whatever waits on it (on today's main, a request thread) goes on."""
    for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
        try:
            os.close(os.open(fifo, flags))
        except OSError:
            pass


def answer_within(seconds: float, call):
    """`call()` in a thread: its result if it came within `seconds`, else fail (the thread is left waiting)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"no answer within {seconds} s: it blocked"
    return box[0]


def plant_fifo_tail(settings, job_id: int) -> Path:
    _, tail = log_paths(settings.log_dir, job_id)
    os.mkfifo(tail)
    return tail


def plant_linked_log_dir(settings, job_id: int, tmp_path: Path) -> Path:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    head, _ = log_paths(elsewhere, job_id)
    os.mkfifo(head)
    moved = settings.log_dir.with_name("logs.moved")
    settings.log_dir.rename(moved)
    settings.log_dir.symlink_to(elsewhere)
    return head


@pytest.mark.parametrize("query", ["", "?offset=0"])
def test_a_fifo_where_a_finished_jobs_tail_log_was_is_a_clean_503_at_once(client, migrated, finished_job, query):
    fifo = plant_fifo_tail(migrated, finished_job)
    try:
        response = answer_within(3, lambda: client.get(f"/train/{finished_job}/log{query}"))
    finally:
        unblock(fifo)
    body = response.get_json()
    assert response.status_code == 503 and body["error"] == "log_unreadable", body
    assert "FIFO, not a regular file" in body["message"] and body["retryable"] is False


def test_a_link_at_logs_is_a_clean_503_at_once(client, migrated, finished_job, tmp_path):
    fifo = plant_linked_log_dir(migrated, finished_job, tmp_path)
    try:
        response = answer_within(3, lambda: client.get(f"/train/{finished_job}/log"))
    finally:
        unblock(fifo)
    body = response.get_json()
    assert response.status_code == 503 and body["error"] == "log_unreadable", body
    assert "symlink, not a directory" in body["message"]


def test_reconcile_closing_a_log_whose_tail_is_a_fifo_fails_at_once(migrated, finished_job):
    fifo = plant_fifo_tail(migrated, finished_job)
    try:
        def close() -> OSError | None:
            try:
                append_note(migrated.log_dir, finished_job, "closing", head_bytes=migrated.log_head_bytes)
            except OSError as exc:
                return exc
            return None
        assert isinstance(answer_within(3, close), OSError)  # ENXIO: nobody reads that FIFO
    finally:
        unblock(fifo)


@pytest.mark.slow
def test_readers_of_a_planted_fifo_do_not_hold_the_threads_a_cancel_needs(service, migrated, finished_job,
                                                                        running_job):
    fifo = plant_fifo_tail(migrated, finished_job)
    results: list[int] = []
    readers = [threading.Thread(target=lambda: results.append(
        timed(service, "GET", f"/train/{finished_job}/log", headers=bearer(TOKEN))[0]), daemon=True)
        for _ in range(READERS)]
    try:
        for reader in readers:
            reader.start()
        time.sleep(1.0)  # every reader has had its answer, or holds a thread on today's main
        code, took = timed(service, "POST", f"/train/{running_job}/cancel", headers=bearer(TOKEN))
        assert code == 202 and took < 1.0, (code, took)
        assert results == [503] * READERS, results
    finally:
        for _ in range(READERS):
            unblock(fifo)
        for reader in readers:
            reader.join(5)


def test_a_link_at_locks_is_refused_never_followed(migrated, tmp_path):
    from lora_worker.host.locks import NotALockFile, hold_lock, is_locked, job_lock_path

    elsewhere = tmp_path / "elsewhere-locks"
    elsewhere.mkdir()
    migrated.lock_dir.mkdir(parents=True, exist_ok=True)
    migrated.lock_dir.rename(migrated.lock_dir.with_name("locks.moved"))
    migrated.lock_dir.symlink_to(elsewhere)
    with pytest.raises(NotALockFile, match="its directory is a symbolic link"):
        hold_lock(job_lock_path(migrated, 1))
    assert list(elsewhere.iterdir()) == []  # nothing was created through the link
    assert is_locked(job_lock_path(migrated, 1))  # something planted counts as held: never "free" by a guess

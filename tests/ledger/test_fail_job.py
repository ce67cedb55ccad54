"""One failure path: `statements.fail_in`, run by `repository.fail_job` and by the supervisor's `fail_job`, is
the only way a row becomes `failed`, and every failed row reads the same way, whoever wrote it: a sentence, an
empty line, the log's last lines (`failure_text`)."""
from __future__ import annotations

import ast
import os
import re

import pytest

from lora_worker.config import REPO_ROOT, Settings
from lora_worker.errors import LaunchFailed
from lora_worker.host import processes
from lora_worker.host.locks import gpu_lock_path, hold_lock
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.repository import (FAILURE_MAX_CHARS, FAILURE_TAIL_LINES, SENTENCE_MAX_CHARS, fail_job,
                                           failure_text)
from lora_worker.reconcile import reconcile
from lora_worker.run.local import launch_supervisor
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.logreader import LogReader
from lora_worker.states import FailureClass, JobState
from tests.helpers import set_modes, wait_for
from tests.helpers.ledger import columns

PACKAGE = REPO_ROOT / "lora_worker"
SENTENCE = re.compile(r"[A-Z][^\n]*[.!?]")


# -- the shape ----------------------------------------------------------------------------------------------------

def test_a_failure_without_a_log_is_one_sentence():
    assert failure_text("The supervisor never started") == "The supervisor never started."
    # never re-cased: a sentence may start with the trainer's own line, as it wrote it
    assert failure_text("sdxl_train_network.py: error: x.") == "sdxl_train_network.py: error: x."
    assert failure_text("  GPU 1 is locked\nby another trainer.  ") == "GPU 1 is locked by another trainer."


def test_a_failure_with_a_log_is_the_sentence_an_empty_line_and_the_last_non_blank_lines():
    lines = [f"line {i}" for i in range(40)] + ["", "   ", "Traceback (most recent call last):", "boom   "]
    text = failure_text("The trainer failed (exit status 1)", lines)
    sentence, blank, tail = text.partition("\n\n")
    assert (sentence, blank) == ("The trainer failed (exit status 1).", "\n\n")
    kept = tail.split("\n")
    assert len(kept) == FAILURE_TAIL_LINES and kept[-2:] == ["Traceback (most recent call last):", "boom"]
    assert kept[0] == f"line {40 - FAILURE_TAIL_LINES + 2}"


def test_a_long_failure_keeps_the_sentence_and_the_end_of_the_log_within_the_cap():
    lines = [f"line {i} " + "x" * 400 for i in range(30)]
    text = failure_text("X" * 5000, lines)
    sentence, _, tail = text.partition("\n\n")
    assert len(text) <= FAILURE_MAX_CHARS and len(sentence) <= SENTENCE_MAX_CHARS
    assert SENTENCE.fullmatch(sentence) and "…" in sentence
    assert tail.startswith("…") and tail.endswith(lines[-1])


def test_fail_job_records_class_text_and_event_and_never_moves_a_finished_row(db):
    job = repo.create_job(db, columns())
    assert fail_job(db, job.id, actor="test", failure_class=FailureClass.CUDA_OOM, sentence="CUDA ran out of memory",
                    log_lines=["torch.OutOfMemoryError"], exit_code=1)
    row = repo.get_job(db, job.id)
    assert (row.status, row.failure_class, row.exit_code) == ("failed", "cuda_oom", 1)
    assert row.error == "CUDA ran out of memory.\n\ntorch.OutOfMemoryError" and row.finished_at is not None
    assert repo.job_events(db, job.id)[-1].reason == "CUDA ran out of memory."
    assert not fail_job(db, job.id, actor="late", failure_class=FailureClass.STALLED, sentence="too late")
    assert repo.get_job(db, job.id).failure_class == "cuda_oom"


# -- every writer, the same shape ---------------------------------------------------------------------------------

def assert_one_shape(db: Database, settings: Settings, job_id: int, failure: str, actor: str) -> str:
    """The row's failure as fail_job writes it; its quoted lines, if any, are the end of the run log."""
    row = repo.get_job(db, job_id)
    assert (row.status, row.failure_class) == ("failed", failure), row.error
    sentence, _, tail = (row.error or "").partition("\n\n")
    assert SENTENCE.fullmatch(sentence), row.error
    assert row.error == failure_text(sentence, tail.split("\n") if tail else ())
    event = repo.job_events(db, job_id)[-1]
    assert (event.to_status, event.actor, event.reason) == ("failed", actor, sentence)
    if tail:
        logged = [line for line in LogReader(settings.log_dir, job_id).tail_lines(100).text.splitlines()
                  if line.strip()]
        if actor != "supervisor":  # reconcile closes the log after the row is written: the quote ends before
            assert logged[-1].startswith(f"[lora-worker] reconcile ({actor}): {sentence.rstrip('.')}")
            logged = logged[:-1]
        assert tail.split("\n")[-1] == logged[-1]
    return tail


def test_dispatchs_launch_failure_has_the_shape(migrated, host, db):
    from lora_worker import create_app

    def cannot_launch(job_id: int, settings: object) -> None:
        raise LaunchFailed(f"The supervisor for job {job_id} exited with status 1 before taking the job.")

    app = create_app(migrated, launch=cannot_launch)
    try:
        response = app.test_client().post("/train", json=host.payload())
    finally:
        app.extensions["lora_worker"].db.dispose()
    assert response.status_code == 503
    (job,) = repo.list_jobs(db)
    assert assert_one_shape(db, migrated, job.id, "launch_error", "api") == ""  # no supervisor, no log


@pytest.mark.slow
def test_the_supervisors_start_failure_has_the_shape(api, host, db):
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    fd = hold_lock(gpu_lock_path(host.settings, 1))  # another trainer took the GPU after admission
    try:
        launch_supervisor(job_id, host.settings)
        wait_for(lambda: repo.get_job(db, job_id).status == "failed", timeout=30, what="the start failure")
    finally:
        assert fd is not None
        os.close(fd)
    assert_one_shape(db, host.settings, job_id, "launch_error", "supervisor")


@pytest.mark.slow
def test_the_supervisors_end_failure_has_the_shape(api, host, db):
    set_modes(host.sd_scripts, crash_at_step=2)
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    launch_supervisor(job_id, host.settings)
    wait_for(lambda: repo.get_job(db, job_id).status == "failed", timeout=60, what="the trainer's crash")
    tail = assert_one_shape(db, host.settings, job_id, "trainer_crashed", "supervisor")
    assert "illegal memory access" in tail


def test_reconciles_failure_has_the_shape_and_quotes_the_run_log(db, migrated):
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", boot_id=processes.boot_id())
    joblog = JobLog(migrated.log_dir, job.id, head_bytes=1 << 20, tail_bytes=1 << 20)
    joblog.feed("loading model\n\nsteps:  10%|#| 4/40\rsteps:  12%|#| 5/40\n")
    joblog.note("the last thing the supervisor said")
    joblog.close()
    reconcile(db, migrated)  # nobody holds the job's lock: its supervisor is gone
    tail = assert_one_shape(db, migrated, job.id, "supervisor_lost", "reconcile")
    assert tail.split("\n") == ["loading model", "steps:  12%|#| 5/40",
                                 "[lora-worker] the last thing the supervisor said"]


# -- nothing else moves a row to failed ---------------------------------------------------------------------------

STATE_CHANGERS = {"transition": 2, "transition_in": 2}  # name -> index of the target state among the arguments
NOT_FAILED = {"QUEUED", "RUNNING", "SUCCEEDED", "CANCELLED"}
# The one statement that writes a failed row, run by both ledger paths (the web's SQLAlchemy one and the
# supervisor's sqlite3 one), each from its `fail_job`.
ONE_WRITER = ("ledger/statements.py", "fail_in")
# They hand their caller's `to` on; their callers are checked.
PASS_THROUGH = {("ledger/repository.py", "transition"), ("ledger/repository.py", "transition_in")}


def failed_writes(source: str, module: str) -> list[str]:
    """Places that may move a row to failed other than `statements.fail_in`: a state change whose target is
    not a literal JobState other than FAILED, a `status=` write, SQL writing 'failed', or a call of `fail_in`
    from anywhere but a ledger path's `fail_job`."""
    found: list[str] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, ast.Call):
            check_call(node, where)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(
                r"(?is)\b(update|insert)\b.*'failed'", node.value):
            found.append(f"{module}:{node.lineno}: SQL writing 'failed'")
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    def check_call(node: ast.Call, where: str) -> None:
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        if name in STATE_CHANGERS and (module, where) not in PASS_THROUGH:
            index = STATE_CHANGERS[name]
            targets = node.args[index:index + 1] + [k.value for k in node.keywords if k.arg == "to"]
            target = targets[0] if targets else None
            state = (target.attr if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                     and target.value.id == "JobState" else None)
            if not (state in NOT_FAILED or (state == "FAILED" and (module, where) == ONE_WRITER)):
                found.append(f"{module}:{node.lineno} {where}: {name}(… {ast.unparse(target) if target else '?'})")
        if name == "values" and any(k.arg == "status" for k in node.keywords):
            found.append(f"{module}:{node.lineno} {where}: .values(status=…)")
        if name == ONE_WRITER[1] and not (module.startswith("ledger/") and where == "fail_job"):
            found.append(f"{module}:{node.lineno} {where}: {name}(…) outside a ledger path's fail_job")

    visit(ast.parse(source), "<module>")
    return found


def test_the_detector_finds_every_other_way_to_fail_a_row():
    snippets = {
        "repo.transition(db, 1, JobState.FAILED, actor='x')": 1,
        "repo.transition(db, 1, outcome.state, actor='x')": 1,  # may be FAILED at run time
        "transition_in(s, 1, to=JobState.FAILED, actor='x')": 1,
        "sql.transition_in(conn, 1, JobState.FAILED, actor='x')": 1,
        "s.execute(update(Job).values(status='failed'))": 1,
        "conn.exec_driver_sql(\"UPDATE jobs SET status = 'failed' WHERE id = ?\", (1,))": 1,
        "conn.execute(\"UPDATE jobs SET status = 'failed' WHERE id = ?\", (1,))": 1,
        "def mark_failed(self):\n    return sql.fail_in(conn, 1, actor='x', failure_class=F, sentence='s')": 1,
        "repo.transition(db, 1, JobState.CANCELLED, actor='x')": 0,
        "repo.fail_job(db, 1, actor='x', failure_class=FailureClass.STALLED, sentence='s')": 0,
        "self.ledger.fail_job(1, failure_class=FailureClass.STALLED, sentence='s')": 0,
    }
    assert {code: len(failed_writes(code, "web/x.py")) for code in snippets} == snippets
    # inside ledger/ too: a second writer next to the one is found
    second = "def mark_failed(conn):\n    return transition_in(conn, 1, JobState.FAILED, actor='x')"
    assert len(failed_writes(second, "ledger/statements.py")) == 1
    assert len(failed_writes(second.replace("mark_failed", "fail_in"), "ledger/statements.py")) == 0


def test_no_code_but_fail_in_moves_a_row_to_failed():
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             for hit in failed_writes(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert found == []


def test_both_ledger_paths_fail_a_row_through_the_one_writer():
    callers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if re.search(r"\bfail_in\(", path.read_text()) and path.name != "statements.py")
    assert callers == ["ledger/repository.py", "ledger/supervisor.py"]


def test_every_writer_of_a_failed_row_calls_fail_job():
    callers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if re.search(r"\bfail_job\(", path.read_text())
                     and not str(path.relative_to(PACKAGE)).startswith("ledger/"))
    # the local supervisor and the Slurm poller both end a run through transcript/ending.py `write_final`
    assert callers == ["dispatch/dispatcher.py", "reconcile.py", "run/jobfiles.py", "slurm/job.py", "slurm/ledger.py",
                       "transcript/ending.py"]

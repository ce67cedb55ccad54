"""How a run ended: `succeeded` needs exit 0, `model saved.` and a verified LoRA; everything else is classed."""
from __future__ import annotations

import ast

import pytest
from sqlalchemy import update

from lora_worker.config import REPO_ROOT
from lora_worker.host.safetensors import ArtifactCheck, ExpectedLora
from lora_worker.ledger import repository as repo
from lora_worker.ledger.models import Job
from lora_worker.ledger.repository import FAILURE_MAX_CHARS, failure_text
from lora_worker.run.local import launch_supervisor
from lora_worker.run.outcome import decide, recorded_lora
from lora_worker.run.parser import Progress
from lora_worker.states import TERMINAL_STATES, FailureClass, JobState
from tests.helpers import set_modes, wait_for

TERMINAL = {s.value for s in TERMINAL_STATES}

OK = ArtifactCheck("/out/x.safetensors")


def progress(*flags: str, signal: int | None = None) -> Progress:
    return Progress(flags=set(flags), signal=signal)


def test_success_needs_all_three():
    assert decide(returncode=0, progress=progress("model_saved"), log_tail=[], artifact=OK).state is JobState.SUCCEEDED
    assert decide(returncode=0, progress=progress("model_saved"), log_tail=[], artifact=OK).lora_path == OK.path
    no_line = decide(returncode=0, progress=progress(), log_tail=[], artifact=OK)
    assert (no_line.state, no_line.failure_class) == (JobState.FAILED, FailureClass.NO_OUTPUT)
    missing = decide(returncode=0, progress=progress("model_saved"), log_tail=[],
                     artifact=ArtifactCheck("/out/x.safetensors", problem="file not found", missing=True))
    assert missing.failure_class is FailureClass.NO_OUTPUT and missing.lora_path is None


@pytest.mark.parametrize("rc, flags, signal, expected", [
    (0, ("no_data",), None, FailureClass.DATASET_INVALID),  # sd-scripts exits 0 with no images
    (1, ("cuda_oom", "inner_exit"), None, FailureClass.CUDA_OOM),
    (1, ("caption_invalid",), None, FailureClass.DATASET_INVALID),
    (1, ("model_load_error",), None, FailureClass.MODEL_LOAD_ERROR),
    (1, ("invalid_arguments",), None, FailureClass.INVALID_ARGUMENTS),
    (1, ("tokenizer_missing",), None, FailureClass.TOKENIZER_MISSING),
    (1, ("died",), 9, FailureClass.KILLED_BY_SIGNAL),  # kernel OOM killer took the trainer, launcher said so
    (-9, (), None, FailureClass.KILLED_BY_SIGNAL),
    (1, (), None, FailureClass.TRAINER_CRASHED),
    (0, (), None, FailureClass.NO_OUTPUT),
])
def test_failure_classes(rc, flags, signal, expected):
    outcome = decide(returncode=rc, progress=progress(*flags, signal=signal), log_tail=["a", "Traceback", "boom"])
    assert (outcome.state, outcome.failure_class) == (JobState.FAILED, expected)
    assert outcome.sentence and "\n" not in outcome.sentence
    assert outcome.log_lines == ("a", "Traceback", "boom")  # quoted by the failed row


def test_exit_code_and_signal_are_kept_apart():
    killed = decide(returncode=-15, progress=progress(), log_tail=[])
    assert (killed.exit_code, killed.signal) == (None, 15)
    launcher = decide(returncode=1, progress=progress("died", signal=9), log_tail=[])
    assert (launcher.exit_code, launcher.signal) == (1, 9)


def test_a_mismatched_or_unreadable_artifact_is_not_success():
    bad = decide(returncode=0, progress=progress("model_saved"), log_tail=[],
                 artifact=ArtifactCheck("/o", problem="rank [8] instead of 16", mismatch=True))
    assert (bad.state, bad.failure_class) == (JobState.FAILED, FailureClass.ARTIFACT_MISMATCH)
    broken = decide(returncode=0, progress=progress("model_saved"), log_tail=[],
                    artifact=ArtifactCheck("/o", problem="truncated"))
    assert broken.failure_class is FailureClass.ARTIFACT_INVALID and broken.lora_path is None


def test_cancel_and_stall_win_over_whatever_the_exit_said():
    assert decide(returncode=-15, progress=progress(), log_tail=[], cancelled=True).state is JobState.CANCELLED
    stalled = decide(returncode=-15, progress=progress(), log_tail=["x"], stalled_in="loading_model")
    assert stalled.failure_class is FailureClass.STALLED and "loading_model" in (stalled.sentence or "")


def test_the_error_keeps_the_end_of_a_long_log():
    lines = [f"line {i} " + "x" * 300 for i in range(100)]
    outcome = decide(returncode=1, progress=progress(), log_tail=lines)
    error = failure_text(outcome.sentence or "", outcome.log_lines)
    assert len(error) <= FAILURE_MAX_CHARS and error.startswith("The trainer failed (exit status 1).\n\n")
    assert error.endswith(lines[-1])


def test_success_and_cancel_carry_no_failure_sentence():
    ok = decide(returncode=0, progress=progress("model_saved"), log_tail=["x"], artifact=OK)
    cancelled = decide(returncode=-15, progress=progress(), log_tail=["x"], cancelled=True)
    assert ok.sentence is None and cancelled.sentence is None and ok.failure_class is None


# -- the artifact is held to what dispatch recorded ---------------------------------------------------------------

def test_the_expected_lora_is_read_from_the_row():
    job = Job(output_name="ohwx", seed=7, lora_rank=8, lora_steps=123, lora_dtype="BF16", tier="fast")
    assert recorded_lora(job) == ExpectedLora(rank=8, output_name="ohwx", steps=123, seed=7, dtype="BF16")


def test_the_run_never_reads_the_tier_or_dtype_constants():
    # Re-deriving the expectation at the end of a run would judge an old job by today's constants.
    run = REPO_ROOT / "lora_worker" / "run"
    for path in sorted(run.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lora_worker.config":
                names = {a.name for a in node.names}
                assert not names & {"TIERS", "Tier", "LORA_DTYPE"}, f"{path.name} imports {names}"
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("TIERS", "LORA_DTYPE"), f"{path.name}:{node.lineno}"


def run_recorded(api, host, db, **recorded: object) -> Job:
    """Accept a job as dispatch does, change what its row expects, then let the real supervisor run it."""
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id).values(**recorded))
    launch_supervisor(job_id, host.settings)
    return wait_for(lambda: (j := repo.get_job(db, job_id)).status in TERMINAL and j, timeout=60,
                    what=f"job {job_id} to end")


@pytest.mark.slow
def test_a_lora_that_matches_the_row_succeeds_though_the_tier_says_otherwise(api, host, db):
    set_modes(host.sd_scripts, rank_override=8)  # the fast tier means rank 16; the row says 8
    done = run_recorded(api, host, db, lora_rank=8)
    assert (done.status, done.failure_class, done.lora_path) == ("succeeded", None, done.lora_file), done.error


@pytest.mark.slow
def test_a_lora_saved_in_another_dtype_than_recorded_is_a_mismatch(api, host, db):
    done = run_recorded(api, host, db, lora_dtype="F16")  # sd-scripts (and the fake) save F32 here
    assert (done.status, done.failure_class) == ("failed", "artifact_mismatch")
    assert "dtype ['F32'] instead of 'F16'" in (done.error or "")

"""How a run ended: `succeeded` needs exit 0, `model saved.` and a verified LoRA; everything else is classed."""
from __future__ import annotations

import pytest

from lora_worker.host.safetensors import ArtifactCheck
from lora_worker.ledger.repository import FAILURE_MAX_CHARS, failure_text
from lora_worker.states import FailureClass, JobState
from lora_worker.run.outcome import decide
from lora_worker.run.parser import Progress

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

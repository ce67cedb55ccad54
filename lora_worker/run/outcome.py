"""Deciding how a run ended, from the exit status, what the output said, and the artifact check. Pure.

"succeeded" needs all three: exit status 0, the `model saved.` line, and a LoRA file that verifies. sd-scripts
exits 0 without writing anything when it finds no images, so exit 0 alone proves nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from lora_worker.host.processes import decode_wait_status, signal_name, split_wait_status
from lora_worker.host.safetensors import ArtifactCheck
from lora_worker.states import FailureClass, JobState
from lora_worker.run.parser import Progress

ERROR_TAIL_LINES = 25
ERROR_MAX_CHARS = 4000


@dataclass(frozen=True)
class Outcome:
    state: JobState
    failure_class: FailureClass | None = None
    error: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    lora_path: str | None = None


# Output markers, strongest evidence first: an OOM explains a crash better than the crash does.
_MARKER_CLASSES = (
    ("cuda_oom", FailureClass.CUDA_OOM, "CUDA ran out of memory"),
    ("caption_invalid", FailureClass.DATASET_INVALID, "a caption file is empty or not UTF-8"),
    ("no_data", FailureClass.DATASET_INVALID, "sd-scripts found no training images (No data found)"),
    ("model_load_error", FailureClass.MODEL_LOAD_ERROR, "the base model could not be loaded"),
    ("invalid_arguments", FailureClass.INVALID_ARGUMENTS, "sd-scripts rejected its arguments"),
    ("tokenizer_missing", FailureClass.TOKENIZER_MISSING, "the CLIP tokenizers could not be loaded offline"),
)


def decide(*, returncode: int | None, progress: Progress, log_tail: list[str], cancelled: bool = False,
           stalled_in: str | None = None, artifact: ArtifactCheck | None = None) -> Outcome:
    exit_code, signal = split_wait_status(returncode)
    if signal is None and progress.signal is not None:
        signal = progress.signal  # the launcher survived and reported how the trainer died
    base = {"exit_code": exit_code, "signal": signal}
    tail, status = _tail(log_tail), decode_wait_status(returncode)
    if cancelled:
        return Outcome(JobState.CANCELLED, error=None, **base)
    if stalled_in is not None:
        return Outcome(JobState.FAILED, FailureClass.STALLED,
                       _message(f"no progress in phase {stalled_in} within its limit; the job was killed", tail),
                       **base)
    saved = "model_saved" in progress.flags
    if returncode == 0 and saved and artifact is not None and artifact.problem is None:
        return Outcome(JobState.SUCCEEDED, lora_path=artifact.path, **base)
    for flag, failure, summary in _MARKER_CLASSES:
        if flag in progress.flags:
            return Outcome(JobState.FAILED, failure, _message(f"{summary} ({status})", tail), **base)
    if signal is not None:
        name = signal_name(signal)
        return Outcome(JobState.FAILED, FailureClass.KILLED_BY_SIGNAL,
                       _message(f"the trainer was killed by {name}", tail), **base)
    if returncode != 0:
        return Outcome(JobState.FAILED, FailureClass.TRAINER_CRASHED,
                       _message(f"the trainer failed ({status})", tail), **base)
    if not saved or artifact is None or artifact.missing:
        where = artifact.path if artifact else "the output directory"
        return Outcome(JobState.FAILED, FailureClass.NO_OUTPUT,
                       _message(f"exit status 0 but no LoRA was saved to {where}", tail), **base)
    failure = FailureClass.ARTIFACT_MISMATCH if artifact.mismatch else FailureClass.ARTIFACT_INVALID
    return Outcome(JobState.FAILED, failure, _message(f"the LoRA file failed verification: {artifact.problem}",
                                                      tail), **base)


def _tail(lines: list[str]) -> str:
    kept = [line for line in lines if line.strip()][-ERROR_TAIL_LINES:]
    return "\n".join(kept)


def _message(summary: str, tail: str) -> str:
    text = summary[0].upper() + summary[1:] + "."
    if not tail:
        return text
    text += "\n--- last lines of the log ---\n"
    room = max(0, ERROR_MAX_CHARS - len(text))
    # The end of the log explains the failure; keep the end when the lines are too long.
    return text + (tail if len(tail) <= room else "…" + tail[len(tail) - room + 1:])

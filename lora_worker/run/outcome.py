"""Deciding how a run ended, from the exit status, what the output said, and the artifact check. Pure.

"succeeded" needs all three: exit status 0, the `model saved.` line, and a LoRA file that verifies against
what dispatch recorded in the row (`recorded_lora`). sd-scripts exits 0 without writing anything when it
finds no images, so exit 0 alone proves nothing. A failure is a sentence and the log's last lines; the
ledger's `fail_job` puts them into the one shape every failed row has.
"""
from __future__ import annotations

import signal as signals
from dataclasses import dataclass

from lora_worker.host.fs import FileId
from lora_worker.host.safetensors import ArtifactCheck, ExpectedLora
from lora_worker.ledger.models import Job
from lora_worker.run.parser import Progress
from lora_worker.states import FailureClass, JobState


@dataclass(frozen=True)
class Outcome:
    state: JobState
    failure_class: FailureClass | None = None
    sentence: str | None = None  # why it failed, for `repo.fail_job`; None unless failed
    exit_code: int | None = None
    signal: int | None = None
    lora_path: str | None = None
    log_lines: tuple[str, ...] = ()  # the output's last lines, quoted by a failure


def recorded_lora(job: Job) -> ExpectedLora:
    """The LoRA this job must produce, as dispatch recorded it in the row (never re-derived from the tier)."""
    return ExpectedLora(rank=job.lora_rank, output_name=job.output_name, steps=job.lora_steps, seed=job.seed,
                        dtype=job.lora_dtype,
                        output_dir_id=FileId.parse(job.output_dev_ino) if job.output_dev_ino else None)


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
    exit_code, signal = _split(returncode)
    if signal is None and progress.signal is not None:
        signal = progress.signal  # the launcher survived and reported how the trainer died
    base = {"exit_code": exit_code, "signal": signal}
    if cancelled:
        return Outcome(JobState.CANCELLED, **base)
    saved = "model_saved" in progress.flags
    if stalled_in is None and returncode == 0 and saved and artifact is not None and artifact.problem is None:
        return Outcome(JobState.SUCCEEDED, lora_path=artifact.path, **base)
    failure, sentence = _failure(returncode, signal, progress, stalled_in, artifact)
    return Outcome(JobState.FAILED, failure, sentence, log_lines=tuple(log_tail), **base)


def _failure(returncode: int | None, signal: int | None, progress: Progress, stalled_in: str | None,
             artifact: ArtifactCheck | None) -> tuple[FailureClass, str]:
    if stalled_in is not None:
        return FailureClass.STALLED, f"no progress in phase {stalled_in} within its limit; the job was killed"
    for flag, failure, summary in _MARKER_CLASSES:
        if flag in progress.flags:
            return failure, f"{summary} ({_status(returncode)})"
    if signal is not None:
        return FailureClass.KILLED_BY_SIGNAL, f"the trainer was killed by {_signal_name(signal)}"
    if returncode != 0:
        return FailureClass.TRAINER_CRASHED, f"the trainer failed ({_status(returncode)})"
    if "model_saved" not in progress.flags or artifact is None or artifact.missing:
        where = artifact.path if artifact else "the output directory"
        return FailureClass.NO_OUTPUT, f"exit status 0 but no LoRA was saved to {where}"
    failure = FailureClass.ARTIFACT_MISMATCH if artifact.mismatch else FailureClass.ARTIFACT_INVALID
    return failure, f"the LoRA file failed verification: {artifact.problem}"


def _split(returncode: int | None) -> tuple[int | None, int | None]:
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, -returncode
    return returncode, None


def _status(returncode: int | None) -> str:
    if returncode is None:
        return "no exit status"
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)}"
    return f"exit status {returncode}"


def _signal_name(signum: int) -> str:
    try:
        return signals.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

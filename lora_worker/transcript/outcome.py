"""Deciding how a run ended, from the exit status, what the output said, and the artifact check. Pure.

"succeeded" needs all three: exit status 0, the `model saved.` line, and a LoRA file that verifies against
what dispatch recorded in the row (`recorded_lora`). sd-scripts exits 0 without writing anything when it
finds no images, so exit 0 alone proves nothing.

A failure names its cause first. Its `sentence` is one line: the line that explains the failure, in full (the
trainer's exception line, which `transcript/explain.py` finds and classes), when there is one, then ` — ` and what the
worker makes of it, with the exit status. `log_lines` are the log's last lines without the launcher's
traceback and its argv dump. The ledger's `fail_job` lays the two out in the one shape every failed row has.

The rules (`explain`) and the LoRA check are imported only when an end is decided (the supervisor loads the
rules once its trainer runs, runner.py `load_the_end`), so the trainer's start waits for neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lora_worker.host.fs import FileId
from lora_worker.host.processes import decode_wait_status, signal_name, split_wait_status
from lora_worker.ledger.statements import failure_text
from lora_worker.states import FailureClass, JobState

if TYPE_CHECKING:
    from lora_worker.host.safetensors import ArtifactCheck, ExpectedLora
    from lora_worker.transcript.parser import Progress

ERROR_TAIL_LINES = 25
CAUSE_MAX_CHARS = 1500  # the explaining line in a sentence; the ledger caps the sentence at 2000


@dataclass(frozen=True)
class Outcome:
    state: JobState
    failure_class: FailureClass | None = None
    sentence: str | None = None  # why it failed, one line, the explaining line first; None unless failed
    exit_code: int | None = None
    signal: int | None = None
    lora_path: str | None = None
    log_lines: tuple[str, ...] = ()  # the log's last lines a failure may quote (no launcher argv dump)

    @property
    def error(self) -> str | None:
        """The `error` the failed row gets: the one shape `fail_job` writes."""
        return failure_text(self.sentence, self.log_lines) if self.sentence is not None else None


class RecordedLora(Protocol):
    """What dispatch recorded of the LoRA to come: a supervisor's JobRecord, or the web's ORM Job."""

    @property
    def lora_rank(self) -> int: ...
    @property
    def output_name(self) -> str: ...
    @property
    def lora_steps(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def lora_dtype(self) -> str: ...
    @property
    def output_dev_ino(self) -> str | None: ...


def recorded_lora(job: RecordedLora) -> ExpectedLora:
    """The LoRA this job must produce, as dispatch recorded it in the row (never re-derived from the tier)."""
    from lora_worker.host.safetensors import ExpectedLora

    return ExpectedLora(rank=job.lora_rank, output_name=job.output_name, steps=job.lora_steps, seed=job.seed,
                        dtype=job.lora_dtype, trained_steps=job.lora_steps,
                        output_dir_id=FileId.parse(job.output_dev_ino) if job.output_dev_ino else None)


def decide(*, returncode: int | None, progress: Progress, log_tail: list[str], cancelled: bool = False,
           stalled_in: str | None = None, signalled: str | None = None, nan_at: int | None = None,
           artifact: ArtifactCheck | None = None) -> Outcome:
    """`stalled_in`, `signalled` (the name of a signal the supervisor got that was no client's cancel) and
    `nan_at` (the step whose loss was NaN) say why the supervisor stopped the run itself; `cancelled`: a client
    asked."""
    from lora_worker.transcript.explain import quotable

    exit_code, signal = split_wait_status(returncode)
    if signal is None and progress.signal is not None:
        signal = progress.signal  # the launcher survived and reported how the trainer died
    base: dict[str, Any] = {"exit_code": exit_code, "signal": signal}
    if cancelled:
        return Outcome(JobState.CANCELLED, **base)
    saved = "model_saved" in progress.flags
    stopped = _stopped_by_us(stalled_in, signalled, nan_at)
    if stopped is None and returncode == 0 and saved and artifact is not None and artifact.problem is None:
        return Outcome(JobState.SUCCEEDED, lora_path=artifact.path, **base)
    failure, summary, cause = _classify(returncode, signal, saved, artifact, log_tail, stopped)
    summary += in_sampling(progress)
    if cause and len(cause) > CAUSE_MAX_CHARS:  # a 90 KB missing-key list: keep its head and the summary
        cause = cause[:CAUSE_MAX_CHARS] + "…"
    sentence = f"{cause} — {summary[0].lower()}{summary[1:]}." if cause else f"{summary}."
    return Outcome(JobState.FAILED, failure, sentence, log_lines=tuple(quotable(log_tail)[-ERROR_TAIL_LINES:]),
                   **base)


Ending = tuple[FailureClass, str, "str | None"]  # (class, the worker's summary, the explaining line or None)


def in_sampling(progress: Progress) -> str:
    """What a run that ended in a sample pass left (`generating sample images at step N` was its last phase):
    sd-scripts draws before the step's save, with no try/except (train_util.py L6360-6491), so that step's
    LoRA was never written."""
    from lora_worker.states import Phase

    if progress.phase is not Phase.SAMPLING or not progress.passes:
        return ""
    step = progress.passes[-1][0]
    if step == 0:
        return "; it ended in the sample pass before the first step: nothing was trained"
    saved = [int(s.text.rsplit("-step", 1)[1][:8]) for s in progress.saves if s.kind == "saving"
             and "-step" in s.text and s.text.rsplit("-step", 1)[1][:8].isdigit()]
    newest = f"the newest step LoRA is step {max(saved)}'s" if saved else "no step LoRA was written"
    return (f"; it ended in the sample pass of step {step}, which runs before that step's save: the step LoRA of "
            f"step {step} was never written ({newest})")


def _stopped_by_us(stalled_in: str | None, signalled: str | None, nan_at: int | None) -> Ending | None:
    """Why the supervisor stopped the run itself, when it did: that, not the trainer's end, is the cause."""
    from lora_worker.transcript.explain import nan_loss_summary, signalled_summary

    if stalled_in is not None:
        return FailureClass.STALLED, f"No progress in phase {stalled_in} within its limit; the job was killed", None
    if signalled is not None:
        return FailureClass.SUPERVISOR_SIGNALLED, signalled_summary(signalled), None
    if nan_at is not None:
        return FailureClass.NAN_LOSS, nan_loss_summary(nan_at), None
    return None


def _classify(returncode: int | None, signal: int | None, saved: bool, artifact: ArtifactCheck | None,
              log_tail: list[str], stopped: Ending | None) -> Ending:
    """(class, the worker's summary, the explaining line or None), strongest evidence first: the supervisor's
    own reason to stop the run (`stopped`), then the trainer's."""
    from lora_worker.transcript.explain import explain

    if stopped is not None:
        return stopped
    why = explain(log_tail) if not (returncode == 0 and saved) else None
    if why is not None and why.failure is not None and why.summary is not None:
        return why.failure, f"{why.summary} ({decode_wait_status(returncode)})", why.line
    return _by_exit(returncode, signal, saved, artifact, why.line if why is not None else None)


def _by_exit(returncode: int | None, signal: int | None, saved: bool, artifact: ArtifactCheck | None,
             cause: str | None) -> Ending:
    """The ending the trainer's exit, its save and the LoRA's verification say, when no line explains it."""
    if signal is not None:
        return FailureClass.KILLED_BY_SIGNAL, f"The trainer was killed by {signal_name(signal)}", cause
    if returncode != 0:
        return FailureClass.TRAINER_CRASHED, f"The trainer failed ({decode_wait_status(returncode)})", cause
    if not saved or artifact is None or artifact.missing:
        where = artifact.path if artifact else "the output directory"
        return FailureClass.NO_OUTPUT, f"Exit status 0 but no LoRA was saved to {where}", cause
    failure = FailureClass.ARTIFACT_MISMATCH if artifact.mismatch else FailureClass.ARTIFACT_INVALID
    return failure, f"The LoRA file failed verification: {artifact.problem}", None




def artifact_values(artifact: ArtifactCheck, *, recorded_commit: str | None) -> dict[str, object]:
    """What a verified LoRA adds to its row: its hash and size, and what its metadata adds to the fingerprint
    (the base model's hash; sd-scripts' commit where the row has none: no .git in the checkout, but
    sd-scripts knew its own commit)."""
    from lora_worker.host.fingerprint import SHA  # only once a LoRA is verified: not on the way to exec

    values: dict[str, object] = {"lora_sha256": artifact.sha256, "lora_size": artifact.size}
    md = artifact.metadata
    if md.get("ss_new_sd_model_hash"):
        values["base_model_sha256"] = md["ss_new_sd_model_hash"]
    commit = md.get("ss_sd_scripts_commit_hash", "")
    if not recorded_commit and SHA.match(commit):
        values["sd_scripts_commit"] = commit
    return values

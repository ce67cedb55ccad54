"""The outcome → row write, for every backend: one terminal write per job, the same columns whoever ran it.

The ledger is whatever the process writes with (the supervisor's sqlite3 ledger, the Slurm poller's); each
call returns False when the row can no longer take that state (someone else ended it first). Retrying a
write the ledger refused (busy, full) is the caller's: the supervisor waits it out holding its lock, the
Slurm poller tries again next cycle with the outcome it decided.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from lora_worker.transcript.outcome import Outcome
from lora_worker.transcript.parser import Progress
from lora_worker.transcript.progress import finite
from lora_worker.states import RESUMABLE, FailureClass, JobState

log = logging.getLogger(__name__)


class FinalLedger(Protocol):
    def mark_succeeded(self, job_id: int, *, reason: str, **values: object) -> bool: ...

    def mark_cancelled(self, job_id: int, *, reason: str, **values: object) -> bool: ...

    def fail_job(self, job_id: int, *, failure_class: FailureClass, sentence: str, log_lines: Iterable[str] = (),
                 **values: object) -> bool: ...


@dataclass(frozen=True)
class Reasons:
    """The events' words for how the backend saw the end."""

    succeeded: str
    cancelled: str
    failed: str = "The run failed"
    failure: FailureClass = FailureClass.SUPERVISOR_LOST  # an outcome without a class (never expected)


def final_values(outcome: Outcome, progress: Progress) -> dict[str, object]:
    return {
        "exit_code": outcome.exit_code, "signal": outcome.signal, "lora_path": outcome.lora_path,
        "step": progress.step, "loss": finite(progress.loss),
        "eta_s": None, "eta_basis": None,  # nothing is left to wait for, whatever the outcome
    }


def write_final(db: FinalLedger, job_id: int, outcome: Outcome, progress: Progress, reasons: Reasons, *,
                artifact: dict[str, object] | None = None) -> bool:
    """The terminal state with the run's last values (and a verified LoRA's, on success); False if refused."""
    values = final_values(outcome, progress)
    if outcome.state is JobState.SUCCEEDED:
        return db.mark_succeeded(job_id, reason=reasons.succeeded, **values, **(artifact or {}))
    if outcome.state is JobState.CANCELLED:
        return db.mark_cancelled(job_id, reason=reasons.cancelled, **values)
    return db.fail_job(job_id, failure_class=outcome.failure_class or reasons.failure,
                       sentence=outcome.sentence or reasons.failed, log_lines=outcome.log_lines, **values)


def ended(outcome: Outcome) -> str:
    """`succeeded`, `cancelled`, or `failed (<class>)`: what a log line says of the end."""
    return outcome.state.value + (f" ({outcome.failure_class.value})" if outcome.failure_class else "")


def serves_no_resume(outcome: Outcome, failure: FailureClass) -> bool:
    """Whether the job's states can serve nothing once it ended so: a success (its LoRA is the result), a client's
    cancel (never undone), a failure whose class a resume would meet again (states.RESUMABLE). `failure`: the class
    the row records for a failed outcome without its own."""
    if outcome.state is not JobState.FAILED:
        return True
    return not RESUMABLE.get(outcome.failure_class or failure, False)


def drop_states(output_dir: str, output_name: str, job_id: int, output_dev_ino: str | None = None) -> None:
    """The saved states of a job that `serves_no_resume` go (host/train_state.py), on both backends, after its final
    row is written: a crash between the two leaves states on disk, never the outcome unrecorded. Best effort: a
    state that cannot be removed costs disk, never the outcome."""
    from lora_worker.host.train_state import remove_states  # only at the end: not on the way to exec

    try:
        removed = remove_states(output_dir, output_name, output_dev_ino)
    except OSError as exc:
        log.warning("job %s: its states were not removed (%s)", job_id, exc)
        return
    if removed:
        log.info("job %s: removed its states %s", job_id, removed)

"""Slurm's job states, mapped onto the ledger's: the state table of the Slurm reference, row by row. Pure.

| Slurm says                          | the row                                                               |
|-------------------------------------|-----------------------------------------------------------------------|
| PENDING (Resources, Priority, …)    | queued, `queue_reason` = Slurm's reason                               |
| RUNNING (COMPLETING, …)             | running; progress from the job's log                                  |
| COMPLETED                           | succeeded only with `model saved.` and a LoRA that verifies (as local)|
| FAILED                              | failed, class from the log and the trainer's own exit status (as local)|
| CANCELLED, the worker asked         | cancelled                                                             |
| CANCELLED, nobody here asked        | failed, killed_by_signal, naming Slurm                                |
| OUT_OF_MEMORY / TIMEOUT / NODE_FAIL | failed, out_of_memory / time_limit / node_fail                        |
| not listed, sacct knows nothing, no .rc file | failed, slurm_lost (scancelled first)                        |
| a state word not in this table      | nothing: no answer (never an ending)                                  |
| (stopped by the poller's watchdog)  | failed, stalled (as local)                                            |
| (the log's loss became NaN)         | failed, nan_loss: stopped by the poller (as local)                    |
| PENDING again after RUNNING         | requeued (despite --no-requeue): scancelled, failed, node_fail        |

The exit status is the trainer's own, as the batch script recorded it in `<id>.rc` (a Popen return code:
negative for a signal), never sacct's, which truncates codes above 127 and reads `0:0` before `15:0`. What the
worker stopped the job for is the follower's to weigh (transcript/follower.py), for both backends: a cancel it
delivered wins over whatever else ended the job meanwhile, a stall or a NaN loss over Slurm's own ending; a job
that completed before its cancel was delivered keeps its own outcome. `ending` gives it Slurm's side of the end.
"""
from __future__ import annotations

from enum import Enum

from lora_worker.transcript.explain import quotable
from lora_worker.transcript.follower import Exit
from lora_worker.transcript.outcome import ERROR_TAIL_LINES, Outcome
from lora_worker.slurm.scheduler import SlurmJob
from lora_worker.states import FailureClass, JobState

PENDING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
RUNNING = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED", "RESIZING"})
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "OUT_OF_MEMORY", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"})
ENDED_BY_SLURM: dict[str, tuple[FailureClass, str]] = {
    "OUT_OF_MEMORY": (FailureClass.OUT_OF_MEMORY, "Slurm killed job {id}: it used more host memory than its "
                      "--mem limit allows (OUT_OF_MEMORY)"),
    "TIMEOUT": (FailureClass.TIME_LIMIT, "Slurm ended job {id}: it ran past its --time limit (TIMEOUT)"),
    "NODE_FAIL": (FailureClass.NODE_FAIL, "Slurm lost the node running job {id} (NODE_FAIL); it was not requeued"),
    "BOOT_FAIL": (FailureClass.NODE_FAIL, "The node for job {id} failed to boot (BOOT_FAIL)"),
}


class Stage(Enum):
    """Where a job is, as the last answer about it says."""

    PENDING = "pending"
    RUNNING = "running"
    ENDED = "ended"
    UNLISTED = "unlisted"  # the commands asked list no such job
    UNKNOWN = "unknown"  # listed with a state word not in this table: no answer about where it is

    @property
    def may_run(self) -> bool:
        """Whether Slurm may still be running the job (nothing said it ended)."""
        return self is not Stage.ENDED

    @property
    def listed_alive(self) -> bool:
        """Whether the answer lists the job as not ended (pending, running, or a state word not known here)."""
        return self in (Stage.PENDING, Stage.RUNNING, Stage.UNKNOWN)


def stage(job: SlurmJob | None) -> Stage:
    if job is None:
        return Stage.UNLISTED
    if job.state in PENDING:
        return Stage.PENDING
    if job.state in RUNNING:
        return Stage.RUNNING
    return Stage.ENDED if job.state in ENDED else Stage.UNKNOWN


def returncode_of(job: SlurmJob | None, recorded: int | None) -> int | None:
    """The trainer's status as a Popen return code: the batch script's record, else what Slurm says."""
    if recorded is not None:
        return recorded
    if job is None:
        return None
    if job.exit_signal:
        return -job.exit_signal
    return job.exit_code


def ending(job: SlurmJob | None, *, slurm_job_id: str, recorded: int | None, cancel_flagged: bool,
           requeued: bool, log_tail: list[str], ran: bool) -> Exit:
    """How a Slurm job that has ended ended, as Slurm's facts for the follower's one end (transcript/follower.py):
    `job` as sacct/scontrol/squeue last said (None if none of them knows it any more), `recorded` the `.rc`
    file's return code, `cancel_flagged` whether a client's cancel is on the row, `requeued` whether the poller
    saw the job pending again after it ran, `ran` whether a trainer of the job ran. The follower weighs them
    against its own reasons to stop the job (a cancel it delivered, a stall, a NaN loss)."""
    returncode = returncode_of(job, recorded)
    cancel_seen = cancel_flagged and job is not None and job.state == "CANCELLED"
    if requeued:  # the poller stopped a second run under the same id; the first one's node was lost
        return Exit(returncode, ran, scheduler=_failed(
            FailureClass.NODE_FAIL, f"Slurm requeued job {slurm_job_id} after it had run (its node was lost, or "
            "requeue is forced); a second run was refused and the job stopped", log_tail, returncode))
    if job is None and recorded is None:
        return Exit(returncode, ran, scheduler=_failed(
            FailureClass.SLURM_LOST, f"Slurm no longer knows job {slurm_job_id} and it left no exit status: it "
            "ended without the worker seeing how", log_tail, returncode))
    state = job.state if job is not None else "COMPLETED" if recorded == 0 else "FAILED"
    if state not in ("COMPLETED", "FAILED"):
        return Exit(returncode, ran, scheduler=_ended_by_slurm(state, job, slurm_job_id, log_tail, returncode),
                    cancel_seen=cancel_seen)
    if returncode is None:
        returncode = 0 if state == "COMPLETED" else 1
    return Exit(returncode, ran)


def _ended_by_slurm(state: str, job: SlurmJob | None, slurm_job_id: str, log_tail: list[str],
                    returncode: int | None) -> Outcome:
    """An ending Slurm itself caused: its limits, its nodes, a cancel nobody here asked for, a preemption."""
    if state in ENDED_BY_SLURM:
        failure, sentence = ENDED_BY_SLURM[state]
        return _failed(failure, sentence.format(id=slurm_job_id), log_tail, returncode)
    if state == "CANCELLED":
        by = job.detail if job is not None and job.detail else "CANCELLED"
        return _failed(FailureClass.KILLED_BY_SIGNAL, f"Slurm cancelled job {slurm_job_id} ({by}); the worker had "
                       "not asked for it", log_tail, returncode, signal=15)
    # DEADLINE, PREEMPTED, REVOKED, SPECIAL_EXIT: Slurm stopped it
    return _failed(FailureClass.KILLED_BY_SIGNAL, f"Slurm ended job {slurm_job_id} ({state})", log_tail, returncode)


def _failed(failure: FailureClass, sentence: str, log_tail: list[str], returncode: int | None,
            signal: int | None = None) -> Outcome:
    exit_code = returncode if returncode is not None and returncode >= 0 else None
    sig = -returncode if returncode is not None and returncode < 0 else signal
    return Outcome(JobState.FAILED, failure, sentence + ".", exit_code=exit_code, signal=sig,
                   log_lines=tuple(quotable(log_tail)[-ERROR_TAIL_LINES:]))

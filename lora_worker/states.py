"""Job states, phases and the transitions allowed between states.

This module imports nothing from the project: the ledger, the supervisor and the API all read it.
"""
from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """Where a job is in its life. A cancel is a flag (`cancel_requested_at`), not a state."""

    QUEUED = "queued"  # row written, supervisor starting (Slurm: waiting for a GPU, `queue_reason` says why)
    RUNNING = "running"  # supervisor holds the job and has (or is about to have) a trainer
    SUCCEEDED = "succeeded"  # trainer exited 0, said "model saved.", and the LoRA file verified
    FAILED = "failed"  # anything else; `failure_class` says what
    CANCELLED = "cancelled"  # stopped on request, every process of the job gone


class Phase(str, Enum):
    """What a running trainer is doing, read from its output."""

    LAUNCHING = "launching"  # launcher importing torch, tokenizers, dataset scan
    LOADING_MODEL = "loading_model"  # reading the base checkpoint (tens of seconds, quiet)
    CACHING_LATENTS = "caching_latents"  # VAE over every image
    CACHING_TEXT_ENCODER_OUTPUTS = "caching_text_encoder_outputs"
    PREPARING_TRAINING = "preparing_training"  # LoRA + optimizer, then a silent sha256 of the base model
    TRAINING = "training"  # the `steps` bar is moving
    SAVING = "saving"  # a `saving checkpoint:` line was seen


class FailureClass(str, Enum):
    """Why a job failed; stored next to `exit_code` and `signal`."""

    CUDA_OOM = "cuda_oom"
    DATASET_INVALID = "dataset_invalid"  # empty or non-UTF-8 caption, or "No data found"
    MODEL_LOAD_ERROR = "model_load_error"  # no such model, or sd-scripts' loader refused its tensors
    TOKENIZER_MISSING = "tokenizer_missing"  # no tokenizer files offline (a TypeError in transformers)
    TOKENIZER_INVALID = "tokenizer_invalid"  # tokenizer files there but broken (an error while tokenizing)
    INVALID_ARGUMENTS = "invalid_arguments"  # argparse refused the command (exit 2 inside)
    KILLED_BY_SIGNAL = "killed_by_signal"
    TRAINER_CRASHED = "trainer_crashed"
    NO_OUTPUT = "no_output"  # exit 0 but no "model saved." or no file
    ARTIFACT_INVALID = "artifact_invalid"  # the file is there but is not a LoRA we can read
    ARTIFACT_MISMATCH = "artifact_mismatch"  # a LoRA, but not the one that was asked for
    STALLED = "stalled"
    NAN_LOSS = "nan_loss"  # the loss became NaN: the supervisor stopped the run (migration 0010)
    SUPERVISOR_LOST = "supervisor_lost"
    # The supervisor got SIGTERM, SIGINT or SIGHUP that was no client's cancel (systemd stopping the unit at a
    # reboot, `systemctl kill`): it stopped the run; nobody asked for the cancel, a new try may pass (0010).
    SUPERVISOR_SIGNALLED = "supervisor_signalled"
    HOST_REBOOTED = "host_rebooted"
    LAUNCH_ERROR = "launch_error"
    # What Slurm (slurm/) reports of a job it ended itself (the state table of docs/reference/slurm.md).
    OUT_OF_MEMORY = "out_of_memory"  # OUT_OF_MEMORY: the job's cgroup hit its --mem (host RAM, not CUDA)
    TIME_LIMIT = "time_limit"  # TIMEOUT: the job ran past its --time
    NODE_FAIL = "node_fail"  # NODE_FAIL: the node was lost under the job (never requeued: --no-requeue)
    SLURM_LOST = "slurm_lost"  # Slurm no longer knows the job and it left no exit status of its own


# The one rule of a cancel, as the 202 body, the README ('First steps') and the OpenAPI document state it (a test
# holds them to it).
# Why `cancelled` even in `saving`: arbo reads `cancelled` as "ended as asked, nothing to do", and a client
# that cancelled does not want the LoRA; a rule without a timing window ("unless the save had begun") is what it
# can act on. The ledger enforces it (ledger/statements.py `transition_in`), on both backends.
CANCEL_RULE = ("A cancel stops the trainer if it still runs, in every phase, `saving` included: the job then ends "
               "`cancelled` (a LoRA being written is moved aside, never reported). A trainer that had already "
               "ended when the cancel reached it keeps its own outcome: `succeeded` with its verified LoRA, or "
               "`failed`. The 202 says the cancel is recorded; the job's final `status` says which of the two it was.")

ACTIVE_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})
TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

# The only moves a row may make. A terminal row never changes again.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

# Failures the same request, unchanged, may not meet again: the host or the run went wrong, not the request
# (a webhook's and a client's `retryable`). A class of the request or its files (dataset, model, arguments),
# or of a run that would end the same way again (out of memory, past its time), is not among them.
RETRYABLE_FAILURES = frozenset({
    FailureClass.KILLED_BY_SIGNAL, FailureClass.TRAINER_CRASHED, FailureClass.STALLED,
    FailureClass.SUPERVISOR_LOST, FailureClass.HOST_REBOOTED, FailureClass.LAUNCH_ERROR, FailureClass.NODE_FAIL,
    FailureClass.SLURM_LOST,
})

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
    # A sample pass (`generating sample images at step N`): the U-Net draws the job's prompts; its own bar is no
    # training step. It runs before the step's save, so a failure here leaves that step's LoRA unwritten.
    SAMPLING = "sampling"
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

# Whether the same request, sent again unchanged, may pass where this failure ended it: the one `retryable` of a
# failed job (webhook bodies, GET /train/<id>; docs/errors.md's "Failure classes" table, which a test holds to this
# one, row by row). True where the host or the run's moment went wrong, not the request; False where the request,
# its files, the trainer or the run's own limits would meet the same end again (a fix comes first).
RETRYABLE: dict[FailureClass, bool] = {
    # arbo's 3090 shares its VRAM with the TTS server, whose use grows and shrinks with its load: admission saw
    # enough free memory at dispatch, so an OOM means another process took some during the run; a later try,
    # with TTS quieter, may pass. (A request too large for any card is refused by admission, not retried.)
    FailureClass.CUDA_OOM: True,
    FailureClass.DATASET_INVALID: False,
    FailureClass.MODEL_LOAD_ERROR: False,
    FailureClass.TOKENIZER_MISSING: False,  # an operator must install the tokenizers first
    FailureClass.TOKENIZER_INVALID: False,
    FailureClass.INVALID_ARGUMENTS: False,
    FailureClass.KILLED_BY_SIGNAL: True,  # killed from outside (the kernel's OOM killer, an operator)
    # An exit the log does not explain (no OOM, no dataset or model error): most often the trainer's own exception,
    # which the same code meets again on the same input and seed. A driver fault of the moment reads the same from
    # here, so a retry is a person's decision after reading `error`, not a client's loop.
    FailureClass.TRAINER_CRASHED: False,
    FailureClass.NO_OUTPUT: False,
    FailureClass.ARTIFACT_INVALID: False,
    FailureClass.ARTIFACT_MISMATCH: False,
    FailureClass.STALLED: True,  # a wait on the driver or the disk, not the request
    FailureClass.NAN_LOSS: False,  # the seed and the data lead to it again: another seed or dataset
    FailureClass.SUPERVISOR_LOST: True,
    FailureClass.SUPERVISOR_SIGNALLED: True,  # the unit stopped (a reboot, `systemctl stop`), nobody's cancel
    FailureClass.HOST_REBOOTED: True,
    FailureClass.LAUNCH_ERROR: True,  # nothing ran (a fork, an exec, a submission that failed)
    FailureClass.OUT_OF_MEMORY: False,  # the job's host RAM is its tier's: the same --mem, the same end
    FailureClass.TIME_LIMIT: False,  # the same steps in the same --time (a resume trains only those left)
    FailureClass.NODE_FAIL: True,
    FailureClass.SLURM_LOST: True,
}

# How each failure class bears on a resume (dispatch/resumable.py): True, the run was cut off from outside and its
# state is as good as it was (a reboot, a lost or signalled supervisor, a kill, a stall, a lost node or Slurm job, a
# time limit, a launch that never ran); False, the trainer or the request would meet the same end again from the
# state, so its follower removes the states with the end (transcript/ending.py `drop_states`).
RESUMABLE: dict[FailureClass, bool] = {
    FailureClass.HOST_REBOOTED: True,
    FailureClass.SUPERVISOR_LOST: True,
    FailureClass.SUPERVISOR_SIGNALLED: True,
    FailureClass.KILLED_BY_SIGNAL: True,
    FailureClass.STALLED: True,
    FailureClass.NODE_FAIL: True,
    FailureClass.SLURM_LOST: True,
    FailureClass.TIME_LIMIT: True,  # a resume trains only the steps left: it does not end the same way
    FailureClass.LAUNCH_ERROR: True,  # nothing ran (a resume that never ran is refused: its original is resumed)
    FailureClass.CUDA_OOM: False,
    FailureClass.OUT_OF_MEMORY: False,
    FailureClass.DATASET_INVALID: False,
    FailureClass.MODEL_LOAD_ERROR: False,
    FailureClass.TOKENIZER_MISSING: False,
    FailureClass.TOKENIZER_INVALID: False,
    FailureClass.INVALID_ARGUMENTS: False,
    FailureClass.TRAINER_CRASHED: False,  # the trainer's own exception: the same code on the same state
    FailureClass.NAN_LOSS: False,  # the state's weights led to it
    FailureClass.NO_OUTPUT: False,
    FailureClass.ARTIFACT_INVALID: False,
    FailureClass.ARTIFACT_MISMATCH: False,
}


def retryable(status: str | None, failure_class: str | None) -> bool | None:
    """A job's `retryable`: None unless it failed; for a failure, RETRYABLE's word (False for a class this
    worker does not know, e.g. one a newer version wrote)."""
    if status != JobState.FAILED.value:
        return None
    known = FailureClass._value2member_map_.get(failure_class or "")
    return RETRYABLE[known] if isinstance(known, FailureClass) else False

"""Whether an ended job can be resumed, and from which of its saved states: right, or refused with reasons.

A state is used only when all of this holds (issue 26), checked without torch:
1. the job ended in a way a resume can follow (`ENDINGS`: every failure class, mapped here explicitly);
2. every file of the state is the trainer's and intact (host/train_state.py), `train_state.json`'s step is the
   directory's, and the ledger saw the run's output say it saved a state at that step (a `checkpoints` row of
   kind `state`, written with the progress: ledger/resumes.states_seen);
3. its step numbering will be right: sd-scripts 48d368fa, resumed with `--skip_until_initial_step`, counts the
   steps of a state past the first epoch from that epoch's start (train_network.py L1340-1344: `global_step =
   initial_step - epoch_to_start * len(train_dataloader)`; proven on the real trainer, docs/reference/
   sd-scripts-resume.md §4), so only a state inside the first epoch is used;
4. the fingerprint matches the job's (dispatch/refingerprint.py): computed last, for the state that passed.
The newest state that passes is chosen; the reasons say why each newer one, or the job, was refused.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_worker.config import Settings
from lora_worker.dispatch import refingerprint as fp
from lora_worker.dispatch.plan import presentation
from lora_worker.host import fs
from lora_worker.host.train_state import Problem, StateCheck, check_state, find_states
from lora_worker.ledger import repository as repo
from lora_worker.ledger import resumes
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job
from lora_worker.states import ACTIVE_STATES, FailureClass, JobState

# How each failure class bears on a resume: True, the run was cut off from outside and its state is as good as
# it was (a reboot, a lost or signalled supervisor, a kill, a stall, a lost node or Slurm job, a time limit, a
# launch that never ran); False, the trainer or the request would meet the same end again from the state.
ENDINGS: dict[FailureClass, bool] = {
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


@dataclass
class Verdict:
    resumable: bool
    from_step: int | None = None
    state: str | None = None  # the state directory's path
    reasons: list[Problem] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"resumable": self.resumable, "from_step": self.from_step, "state": self.state,
                "reasons": [{"code": p.code, "message": p.message} for p in self.reasons]}


def steps_per_epoch_at_least(job: Job) -> int | None:
    """A lower bound of sd-scripts' batches per epoch, as the one presentation of a dataset says it (dispatch/plan.py:
    ceil(images × repeats / batch size)); None when the batch size is not in the argv."""
    batch = fp.batch_size_of(job.argv)
    return presentation(job.image_count, job.repeats, batch, job.total_steps).first_epoch_steps_at_least \
        if batch else None


def ending_problems(db: Database, job: Job) -> list[Problem]:
    state = JobState(job.status)
    if state in ACTIVE_STATES:
        return [Problem("job_not_ended", f"job {job.id} is {state.value}")]
    if state is JobState.SUCCEEDED:
        return [Problem("job_succeeded", f"job {job.id} succeeded; its LoRA is {job.lora_path}")]
    if state is JobState.CANCELLED:
        return [Problem("job_cancelled", f"job {job.id} was cancelled")]
    if job.resumed_from is not None and job.failure_class == FailureClass.LAUNCH_ERROR.value:
        # It resumed nothing (resumes.resume_of leaves it out): the job it was to resume is the one resumed, so
        # that one chain of resumes continues one run
        return [Problem("resume_never_ran", f"job {job.id}, a resume of job {job.resumed_from}, failed to launch "
                        f"before any trainer ran: resume job {job.resumed_from} instead")]
    if job.failure_class is None or not ENDINGS.get(FailureClass(job.failure_class), False):
        return [Problem("failure_recurs", f"job {job.id} failed with {job.failure_class}, which a resume would "
                        "meet again")]
    if (later := resumes.resume_of(db, job.id)) is not None:
        return [Problem("already_resumed", f"job {job.id} was resumed as job {later.id}")]
    return []


def verdict(db: Database, settings: Settings, job: Job, *,
            seen: Callable[[Settings, Job], set[int]] | None = None) -> Verdict:
    """Whether `job` can be resumed, from which state, and why not (every reason found)."""
    problems = ending_problems(db, job)
    if problems:
        return Verdict(False, reasons=problems)
    problems = _output_problems(job)
    if problems:
        return Verdict(False, reasons=problems)
    try:
        states = find_states(job.output_dir, job.output_name)
    except OSError as exc:
        return Verdict(False, reasons=[Problem("state_file_invalid", f"{job.output_dir} cannot be listed: {exc}")])
    if not states:
        return Verdict(False, reasons=[Problem("no_state", f"no {job.output_name}-step*-state in {job.output_dir}")])
    saved = _seen_in_chain(db, settings, job, seen or (lambda _settings, j: resumes.states_seen(db, j.id)))
    refused: list[Problem] = []
    for name, step in states:
        check = check_state(job.output_dir, name, rank=job.lora_rank)
        _check_numbering(job, check, saved)
        if check.problems:
            refused += check.problems
            continue
        problems = fingerprint_problems(job, settings)
        if problems:
            return Verdict(False, reasons=refused + problems)
        return Verdict(True, from_step=step, state=os.path.join(job.output_dir, name), reasons=refused)
    return Verdict(False, reasons=refused)


def _output_problems(job: Job) -> list[Problem]:
    """The output directory must still be the one the job wrote into, and hold no file at the LoRA's path."""
    try:
        now = str(fs.identity_of_dir(job.output_dir))
    except OSError as exc:
        return [Problem("output_dir_replaced", f"{job.output_dir} cannot be opened without following a link: {exc}")]
    if job.output_dev_ino and now != job.output_dev_ino:
        return [Problem("output_dir_replaced", f"{job.output_dir} is not the directory the job wrote into")]
    dir_fd = fs.open_dir(job.output_dir)
    try:
        if fs.entry_at(dir_fd, os.path.basename(job.lora_file)) is not None:
            return [Problem("lora_file_exists", f"{job.lora_file} exists (a save cut short?); a resume never "
                            "overwrites it: move it aside first")]
    finally:
        os.close(dir_fd)
    return []


def _seen_in_chain(db: Database, settings: Settings, job: Job, seen: Callable[[Settings, Job], set[int]]) -> set[int]:
    """The state saves the job and the jobs it resumed saw: they share the output directory, and a resume
    that died before its first save leaves its original's state to be resumed from."""
    steps: set[int] = set()
    current: Job | None = job
    hops = 0
    while current is not None and hops < 100:
        steps |= seen(settings, current)
        current = repo.find_job(db, current.resumed_from) if current.resumed_from else None
        hops += 1
    return steps


def _check_numbering(job: Job, check: StateCheck, saved: set[int]) -> None:
    if check.problems:
        return
    if check.step not in saved:
        check.refuse("state_not_seen", f"the ledger saw no `saving state at step {check.step}` in the run's output")
    per_epoch = steps_per_epoch_at_least(job)
    if per_epoch is None or check.step >= per_epoch:
        check.refuse("state_past_first_epoch", f"step {check.step} is not inside the first epoch (at least "
                     f"{per_epoch} steps: {job.image_count} images × {job.repeats} repeats / batch size "
                     f"{fp.batch_size_of(job.argv)}); sd-scripts would "
                     "number the resumed steps from that epoch's start")
    if check.step >= job.total_steps:
        check.refuse("state_at_last_step", f"step {check.step} is the last step: nothing is left to train")


def fingerprint_problems(job: Job, settings: Settings) -> list[Problem]:
    problems = fp.command_problems(job, settings) + fp.trainer_problems(job, settings) + fp.dataset_problems(job)
    if problems:
        return problems
    step_loras = sorted((n for n in _names(job.output_dir) if n.startswith(f"{job.output_name}-step")
                         and n.endswith(".safetensors")), reverse=True)
    return fp.base_model_problems(job, step_loras)


def _names(directory: str) -> list[str]:
    try:
        dir_fd = fs.open_dir(directory)
    except OSError:
        return []
    try:
        return [name for name, st in fs.list_entries(dir_fd) if fs.kind_of(st.st_mode) == "regular file"]
    finally:
        os.close(dir_fd)

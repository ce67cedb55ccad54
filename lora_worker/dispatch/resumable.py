"""Whether an ended job can be resumed, and from which of its saved states: right, or refused with reasons.

A state is used only when all of this holds (issue 26), checked without torch:
1. the job ended in a way a resume can follow (`ENDINGS`: every failure class, mapped here explicitly);
2. every file of the state is the trainer's and intact (host/train_state.py), `train_state.json`'s step is the
   directory's, and the ledger saw the run's output say it saved a state at that step (a `checkpoints` row of
   kind `state`, written with the progress: ledger/resumes.states_seen);
3. its step numbering will be right: sd-scripts 48d368fa, resumed with `--skip_until_initial_step`, counts the
   steps of a state past the first epoch from that epoch's start (train_network.py L1340-1344: `global_step =
   initial_step - epoch_to_start * len(train_dataloader)`; proven on the real trainer, docs/reference/
   sd-scripts-resume.md §4), so only a state inside the first epoch is used. A job accepted since issue 32 was
   shown one epoch covering the run (dispatch/presentation.py): every state it saves is inside it. A row before
   it (`--train_data_dir`: the folder's repeats) keeps the rule;
4. the fingerprint matches the job's (dispatch/refingerprint.py): computed once, for the first state whose cheaper
   checks passed, before any archive is read.
The newest state that passes is chosen; the reasons say why each newer one, or the job, was refused.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_worker.config import Settings
from lora_worker.dispatch import refingerprint as fp
from lora_worker.host import fs
from lora_worker.dispatch.presentation import Presentation, config_path_of, presentation
from lora_worker.host.state_archives import Budget
from lora_worker.host.train_state import Problem, StateCheck, check_archives, check_state, find_states
from lora_worker.ledger import repository as repo
from lora_worker.ledger import resumes
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job
from lora_worker.states import ACTIVE_STATES, RESUMABLE, FailureClass, JobState

ENDINGS = RESUMABLE  # how each failure class bears on a resume (states.py: the follower drops what none can use)


@dataclass
class Verdict:
    resumable: bool
    from_step: int | None = None
    state: str | None = None  # the state directory's path
    reasons: list[Problem] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"resumable": self.resumable, "from_step": self.from_step, "state": self.state,
                "reasons": [{"code": p.code, "message": p.message} for p in self.reasons]}


def presentation_of(job: Job) -> Presentation | None:
    """What sd-scripts made of the job's dataset (None when its argv names no batch size): one epoch covering the
    run for a job given a `--dataset_config` (the one rule, dispatch/presentation.py; the fingerprint then holds
    the config's name to its content), the kohya folder's own repeats for a row given `--train_data_dir`."""
    batch, every = fp.batch_size_of(job.argv), _int_flag(job.argv, "--save_every_n_steps=")
    if not batch or not job.image_count or not job.total_steps:
        return None
    folder_repeats = None if config_path_of(job.argv) is not None else job.repeats
    return presentation(job.image_count, batch, job.total_steps, every or job.total_steps,
                        folder_repeats=folder_repeats)


def _int_flag(argv: list[str], flag: str) -> int | None:
    token = next((a[len(flag):] for a in argv if a.startswith(flag)), "")
    return int(token) if token.isdigit() else None


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


def verdict(db: Database, settings: Settings, job: Job, *, seen: Callable[[Settings, Job], set[int]] | None = None,
            clock: Callable[[], float] = time.monotonic) -> Verdict:
    """Whether `job` can be resumed, from which state, and why not (every reason found). Cheapest first: the
    ledger's rows (how the job ended, the saves its run said), the step arithmetic (nothing opened), each state's
    names, kinds and sizes and its small files, the fingerprint, and only then, for the newest state that passed
    all of it, its archives' CRCs (within one budget of bytes and time for the whole verdict, and remembered by
    the files' identities: host/state_archives.py)."""
    problems = ending_problems(db, job) or _output_problems(job)
    if problems:
        return Verdict(False, reasons=problems)
    try:
        states = find_states(job.output_dir, job.output_name)
    except OSError as exc:
        return Verdict(False, reasons=[Problem("state_file_invalid", f"{job.output_dir} cannot be listed: {exc}")])
    if not states:
        return Verdict(False, reasons=[Problem("no_state", f"no {job.output_name}-step*-state in {job.output_dir}")])
    saved = _seen_in_chain(db, settings, job, seen or (lambda _settings, j: resumes.states_seen(db, j.id)))
    shown, budget = presentation_of(job), Budget.start(clock)
    refused: list[Problem] = []
    fingerprint: list[Problem] | None = None
    for name, step in states:
        check = _check_numbering(job, shown, StateCheck(name, step), saved)
        if not check.problems:
            check = check_state(job.output_dir, name, rank=job.lora_rank, archives=False)
        if not check.problems:
            fingerprint = fingerprint_problems(job, settings) if fingerprint is None else fingerprint
            if fingerprint:
                return Verdict(False, reasons=refused + fingerprint)
            check = check_archives(job.output_dir, name, budget)
        if check.problems:
            refused += check.problems
            continue
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


def _check_numbering(job: Job, shown: Presentation | None, check: StateCheck, saved: set[int]) -> StateCheck:
    """The ledger's rows and the step arithmetic alone, by the directory's name: nothing is opened."""
    if check.step not in saved:
        check.refuse("state_not_seen", f"the ledger saw no `saving state at step {check.step}` in the run's output")
    if shown is None or check.step >= shown.first_epoch_steps_at_least:
        check.refuse("state_past_first_epoch", f"step {check.step} is not inside the first epoch (at least "
                     f"{shown.first_epoch_steps_at_least if shown else None} steps: {job.image_count} images × "
                     f"{shown.repeats if shown else job.repeats} repeats / batch size {fp.batch_size_of(job.argv)}); "
                     "sd-scripts would number the resumed steps from that epoch's start")
    if check.step >= job.total_steps:
        check.refuse("state_at_last_step", f"step {check.step} is the last step: nothing is left to train")
    return check


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

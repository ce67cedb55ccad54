"""Why a request about an ended job is refused, by reason code: a resume's (`GET/POST /train/<id>/resume`
`reasons[].code`) and a promote's (`POST /train/<id>/promote` `details.reason`). docs/errors.md's "Resume refusals"
and "Promote refusals" tables hold them word for word (tests); lora_worker/errors.py re-exports both. This module
imports nothing of the project.
"""
from __future__ import annotations


# Why POST /train/<id>/promote refuses a step (`details.reason`): docs/errors.md's "Promote refusals" table holds
# it word for word (a test); dispatch/promote.py says them.
PROMOTE_REASONS: dict[str, str] = {
    "job_not_succeeded": "Only a job that succeeded has a result to replace; a queued or running one may later.",
    "no_step_lora": "The job (or the jobs it resumed) saved no step LoRA at this step.",
    "not_verified": "The step LoRA of this step failed its verification, or was never judged.",
    "removed": "The trainer pruned the step LoRA of this step: it is gone from the disk.",
    "file_changed": "The step LoRA is not the file that was verified any more (gone, a link, or other bytes).",
}


# Why a job's saved state is not used for a resume (GET/POST /train/<id>/resume `reasons[].code`): the one
# list, which docs/errors.md's "Resume refusals" table holds word for word (a test). dispatch/resume.py and
# host/train_state.py say them.
RESUME_REASONS: dict[str, str] = {
    "job_not_ended": "The job is still queued or running: only an ended job is resumed.",
    "job_succeeded": "The job succeeded: its LoRA is there, nothing is left to train.",
    "job_cancelled": "The job was cancelled: a cancel is a client's decision, never undone by a resume.",
    "failure_recurs": "The job failed in a way a resume would meet again (the request, its files or the run's "
                      "own limits: failure_class says which); only a reboot, a lost supervisor, a kill by a "
                      "signal or a stall is resumed.",
    "already_resumed": "A resume of this job exists already (`details.resumed_by`): resume that one if it failed.",
    "resume_never_ran": "The job is a resume whose launch failed before any trainer ran: it resumed nothing and "
                        "counts as no resume, so the job it was to resume (`resumed_from`) is resumed instead.",
    "output_dir_replaced": "The job's output directory is gone or is not the one it wrote into.",
    "lora_file_exists": "A file is at the LoRA's path already (a final save cut short?): never overwritten; "
                        "move it aside to resume.",
    "no_state": "The job left no saved state in its output directory.",
    "state_incomplete": "A file the trainer's resume loads is missing from the state.",
    "state_file_invalid": "A file of the state is a link, a FIFO or a directory, not a regular file.",
    "state_json_invalid": "train_state.json is not the small JSON sd-scripts writes.",
    "state_step_mismatch": "train_state.json's step is not the step the state's directory is named for.",
    "state_not_seen": "The run's output never said it saved a state at this step: the files were not the "
                      "trainer's, or its save was cut short.",
    "state_model_invalid": "The state's model.safetensors fails the LoRA header check (truncated, or another rank).",
    "state_archive_corrupt": "A torch archive of the state (optimizer, scheduler, RNG) is not an intact zip: a "
                             "member's CRC-32 fails or the file is cut short.",
    "state_unverifiable": "The state's archives are larger than a check reads, took longer (one bound per request), "
                          "or list more members than a torch archive: not verified, so not used.",
    "state_past_first_epoch": "The state lies past the first epoch (an older job's): sd-scripts counts a resume's "
                              "steps from that epoch's start, so the run would train more steps than asked.",
    "state_at_last_step": "The state is at the job's last step: nothing is left to train from it.",
    "fingerprint_argv": ("The trainer command the worker builds now, for the job's own backend, differs from the "
                         "job's (settings changed)."),
    "fingerprint_batch_size": ("The batch size the worker's settings give the job's own backend now (its card's, or "
                               "its tier's Slurm resources) differs from the job's."),
    "fingerprint_dataset": "The dataset's content hash differs from the one recorded at dispatch.",
    "fingerprint_base_model": "The base model's sha256 differs from the one the run trained on.",
    "fingerprint_trainer": "The sd-scripts commit or the trainer's package versions differ from the job's.",
    "fingerprint_unknown": "A part of the fingerprint cannot be known now (the dataset or base model unreadable, "
                           "no step LoRA naming the base model's hash).",
}

"""A resume: a NEW job row continuing an ended job from its newest good state, launched as POST /train's are.

The row copies the original's request (paths, tier, seed, the LoRA it must produce, the webhook subscription),
its fingerprint and its argv, with `--resume=<state dir>` and `--skip_until_initial_step` added: without the
latter sd-scripts 48d368fa restarts `global_step` at 0 and retrains the steps already done (train_network.py
L1257-1273); with it, a state inside the first epoch (the only kind dispatch/resumable.py passes) is resumed
at its own step, and the run trains exactly the steps left. `resumed_from`, `attempt` and `resume_step` link it
to the original (migration 0014). Admission, the INSERT and the launch are the dispatcher's, the same as a new
job's (no second launch path); under Slurm that is a new sbatch of the same sandboxed argv.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from lora_worker.backends import backend_of
from lora_worker.dispatch.dataset import inspect_dataset
from lora_worker.dispatch.dispatcher import Dispatcher
from lora_worker.dispatch.refingerprint import config_of, resolved, without_resume_flags
from lora_worker.dispatch.resumable import Verdict, verdict
from lora_worker.dispatch.samples import disk_counts, prompts_file, write_prompts
from lora_worker.errors import JobActive, NotResumable
from lora_worker.host import fs, kohya
from lora_worker.ledger import repository as repo
from lora_worker.ledger import resumes
from lora_worker.ledger.models import Job
from lora_worker.transcript.eta import estimate_resume

# What a resumed row takes from the original as it is: the request, the LoRA it must produce, the fingerprint.
COPIED = ("train_id", "dataset_dir", "base_model_path", "output_dir", "output_name", "trigger", "subject_class",
          "repeats", "tier", "device_index", "seed", "max_grad_norm", "lora_target_modules", "image_count", "env",
          "total_steps", "lora_file", "lora_rank", "lora_steps", "lora_dtype", "dataset_sha256", "base_model_sha256",
          "sd_scripts_commit", "trainer_versions", "webhook_events", "base_model_identity", "sample_prompts",
          "dataset_warnings")


def body_digest(job_id: int) -> str:
    """What an Idempotency-Key of a resume is bound to: the job resumed (a key of POST /train is another body)."""
    return hashlib.sha256(f"resume of job {job_id}".encode()).hexdigest()


def resume_argv(original: Job, state_dir: str) -> list[str]:
    return [*without_resume_flags(original.argv), f"--resume={state_dir}", "--skip_until_initial_step"]


def resume(dispatcher: Dispatcher, job_id: int, *, idempotency_key: str | None = None,
           actor: str = "api") -> tuple[Job, bool]:
    """Start the resume of `job_id` (or, with a key seen before, the one it started); NotResumable with the
    reasons when no state passes, JobActive when the job itself (or another) is active."""
    digest = body_digest(job_id)
    return dispatcher.accept(lambda: _create(dispatcher, job_id, idempotency_key, digest, actor),
                             idempotency_key=idempotency_key, body_sha256=digest)


def _create(dispatcher: Dispatcher, job_id: int, idempotency_key: str | None, digest: str, actor: str) -> Job:
    original = repo.get_job(dispatcher.db, job_id)
    # The run continues where it ran: the original's backend (its device profile, its environment, its admission),
    # not the one the settings now give new jobs.
    dispatcher = replace(dispatcher, backend=backend_of(original, dispatcher.backend))
    found = verdict(dispatcher.db, dispatcher.settings, original)
    refuse(dispatcher, original, found)
    assert found.state is not None and found.from_step is not None
    # As the fingerprint rebuilt its command: the same prompts file and dataset config.
    request = resolved(original, dispatcher.settings)
    dispatcher.admit(original.tier, original.device_index, Path(original.output_dir), original.lora_rank,
                     disk_counts(request.samples, original.lora_steps - found.from_step,
                                 dispatcher.settings.save_every_n_steps(original.tier)), resuming=True)
    manifest = inspect_dataset(Path(original.dataset_dir),
                               kohya.folder_name(original.repeats, original.trigger, original.subject_class))
    columns: dict[str, Any] = {
        **{name: getattr(original, name) for name in COPIED}, **manifest.identities(),
        "argv": resume_argv(original, found.state), "backend": dispatcher.backend.name,
        "idempotency_key": idempotency_key, "request_sha256": digest,
        "resumed_from": original.id, "attempt": original.attempt + 1, "resume_step": found.from_step,
        "estimated_duration_s": _estimate(original, found.from_step),
    }
    output_id = str(fs.identity_of_dir(original.output_dir))
    # The same prompts file and dataset config its argv names (the verdict rebuilt the argv: the same paths, so the
    # same bytes), written again: the run may be long gone and retention with it.
    write_prompts(prompts_file(request.samples, request.tier, dispatcher.settings, dispatcher.backend))
    config = config_of(original, request, dispatcher.settings, dispatcher.backend)
    job = dispatcher.launch(columns, Path(original.output_dir), output_id=output_id, config=config)
    resumes.note(dispatcher.db, original.id, actor=actor,
              reason=f"resumed as job {job.id} from step {found.from_step} ({found.state})")
    return job


def _estimate(original: Job, from_step: int) -> float | None:
    pre_training = None
    if original.started_at and original.training_started_at:
        pre_training = (original.training_started_at - original.started_at).total_seconds()
    return estimate_resume(pre_training_s=pre_training, rate=original.rate,
                           steps_left=original.total_steps - from_step, whole_s=original.estimated_duration_s)


def refuse(dispatcher: Dispatcher, original: Job, found: Verdict) -> None:
    """The answer to a resume no state allows: 409 while the job itself is active, else 422 with the reasons."""
    if found.resumable:
        return
    if any(p.code == "job_not_ended" for p in found.reasons):
        raise JobActive(f"Job {original.id} is still {original.status}; only an ended job is resumed.",
                        active_job_id=original.id)
    details: dict[str, Any] = {"reasons": found.as_dict()["reasons"]}
    if any(p.code == "already_resumed" for p in found.reasons) and (
            later := resumes.resume_of(dispatcher.db, original.id)) is not None:
        details["resumed_by"] = later.id
    raise NotResumable(f"Job {original.id} cannot be resumed: " + "; ".join(p.message for p in found.reasons[:3]),
                       job_id=original.id, **details)

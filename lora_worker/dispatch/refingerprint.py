"""A resume's fingerprint: what the job's run was made of, recomputed now and compared with the row.

A resume continues the optimizer, the LR schedule and the RNG of a run; with anything of it changed the run
that comes out is neither the one asked for nor a new one. So the trainer command the worker would build for
the request now (settings: launcher, trainer paths, batch size…, and the dataset's presentation: the
`--dataset_config` named by its content, the repeats sd-scripts sees) must be the job's, resume flags left out, built
for the job's own backend (the row's `backend`: its device profile, never the one the settings now give new jobs,
so a worker switched between backends still resumes its older rows); the
dataset's manifest hash (names, sizes, captions) the one recorded at dispatch; the sd-scripts commit and the
trainer's package versions the recorded ones; and the base model the very file recorded at dispatch (its
identity), with every sha256 the run recorded of it agreeing. Nothing here imports torch.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from lora_worker.backends import Backend, backend_of
from lora_worker.config import Settings
from lora_worker.dispatch.argv import build_argv
from lora_worker.dispatch.dataset import inspect_dataset
from lora_worker.dispatch.presentation import DatasetConfig, config_for, config_path_of
from lora_worker.dispatch.request import ResolvedRequest, TrainRequest, resolve_request
from lora_worker.errors import LoraWorkerError
from lora_worker.host import fs, kohya
from lora_worker.host.fingerprint import sd_scripts_commit, trainer_versions
from lora_worker.host.safetensors import HeaderError, read_header
from lora_worker.host.train_state import Problem
from lora_worker.ledger.models import Job

# What a resume's argv adds, and what it leaves out: a resume's first pass would draw its state's weights, not the
# base model's, under the base model's name (`e000000`), so it never samples at first.
RESUME_FLAGS = ("--resume=", "--skip_until_initial_step", "--sample_at_first")
BATCH_SIZE = "--train_batch_size="


def without_resume_flags(argv: Iterable[str]) -> list[str]:
    return [a for a in argv if not a.startswith(RESUME_FLAGS)]


def batch_size_of(argv: Iterable[str]) -> int | None:
    token = next((a for a in argv if a.startswith(BATCH_SIZE)), None)
    return int(token[len(BATCH_SIZE):]) if token and token[len(BATCH_SIZE):].isdigit() else None


def request_of(job: Job) -> TrainRequest:
    return TrainRequest(dataset_dir=job.dataset_dir, base_model_path=job.base_model_path, output_dir=job.output_dir,
                        output_name=job.output_name, trigger=job.trigger, subject_class=job.subject_class,
                        repeats=job.repeats, tier=job.tier, device_index=job.device_index, seed=job.seed,
                        max_grad_norm=job.max_grad_norm, lora_target_modules=job.lora_target_modules,
                        samples=tuple(job.sample_prompts) if job.sample_prompts is not None else ())


def resolved(job: Job, settings: Settings) -> ResolvedRequest:
    return resolve_request(request_of(job), train_id=job.train_id, dataset_dir=Path(job.dataset_dir),
                           base_model_path=Path(job.base_model_path), output_dir=Path(job.output_dir),
                           tiers=settings.tiers)


def config_of(job: Job, request: ResolvedRequest, settings: Settings, backend: Backend) -> DatasetConfig | None:
    """The dataset config the worker makes of the job's request now (so a resume writes it again), or None for a
    row presented by `--train_data_dir` (accepted before there was one): its resume keeps the folder's repeats."""
    if config_path_of(job.argv) is None:
        return None
    return config_for(request, settings, backend, job.image_count)


def command_problems(job: Job, settings: Settings) -> list[Problem]:
    """The trainer command and batch size the worker builds for this request now, on the job's own backend,
    against the job's."""
    backend = backend_of(job)
    try:
        batch_now = backend.profile(settings, job.tier, job.device_index).train_batch_size
    except KeyError:
        return [Problem("fingerprint_unknown", f"device {job.device_index} is not in the settings now: its batch "
                        "size is not known")]
    problems = []
    if batch_size_of(job.argv) != batch_now:
        problems.append(Problem("fingerprint_batch_size", f"the job trained with batch size "
                                f"{batch_size_of(job.argv)}, the settings give {batch_now} on {backend.label} now"))
    try:
        request = resolved(job, settings)
        argv_now = without_resume_flags(build_argv(request, settings, backend,
                                                   config_of(job, request, settings, backend)))
    except LoraWorkerError as exc:
        return [*problems, Problem("fingerprint_unknown", f"the job's command cannot be built now: {exc.message}")]
    before = without_resume_flags(job.argv)
    if argv_now != before:
        changed = sorted(set(argv_now) ^ set(before))[:4]
        problems.append(Problem("fingerprint_argv", f"the trainer command differs from the job's: {changed}"))
    return problems


def trainer_problems(job: Job, settings: Settings) -> list[Problem]:
    commit, versions = sd_scripts_commit(settings.sd_scripts_dir), trainer_versions(settings.accelerate)
    if commit is None or job.sd_scripts_commit is None:
        return [Problem("fingerprint_unknown", "the sd-scripts commit is not known (no .git in the checkout)")]
    problems = []
    if commit != job.sd_scripts_commit:
        problems.append(Problem("fingerprint_trainer",
                                f"sd-scripts is at {commit}, the job ran {job.sd_scripts_commit}"))
    if versions != (job.trainer_versions or {}):
        problems.append(Problem("fingerprint_trainer", f"the trainer's packages are {versions}, the job ran "
                                f"{job.trainer_versions or {}}"))
    return problems


def dataset_problems(job: Job) -> list[Problem]:
    try:
        manifest = inspect_dataset(Path(job.dataset_dir), kohya.folder_name(job.repeats, job.trigger,
                                                                             job.subject_class))
    except LoraWorkerError as exc:
        return [Problem("fingerprint_unknown", f"the dataset cannot be read now: {exc.message}")]
    if manifest.sha256() != job.dataset_sha256:
        return [Problem("fingerprint_dataset", "the dataset's images or captions changed since the job was accepted")]
    return []


def model_identity(path: str) -> str:
    """What proves the base model is the file the run trained on, unchanged: device, inode, size, mtime and
    ctime (no one can set a ctime back), read without following a link. Hashing the 6.9 GB file instead would
    cost seconds a request."""
    fd, st = fs.open_regular(None, path)
    os.close(fd)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def base_model_problems(job: Job, step_loras: Iterable[str]) -> list[Problem]:
    """The base model must be the very file recorded at dispatch, and the run's own records of its sha256 (the
    verified LoRA's, each step LoRA's `ss_new_sd_model_hash`) must agree."""
    if job.base_model_identity is None:
        return [Problem("fingerprint_unknown", "the job was accepted before base model identities were recorded")]
    try:
        now = model_identity(job.base_model_path)
    except OSError as exc:
        return [Problem("fingerprint_unknown", f"the base model cannot be read: {exc}")]
    if now != job.base_model_identity:
        return [Problem("fingerprint_base_model", f"{job.base_model_path} was replaced or modified since the job "
                        "was accepted")]
    hashes = {h for h in (job.base_model_sha256, *(_model_hash(job, n) for n in step_loras)) if h}
    if len(hashes) > 1:
        return [Problem("fingerprint_base_model", f"the run's LoRAs name different base models: {sorted(hashes)}")]
    return []


def _model_hash(job: Job, name: str) -> str | None:
    try:
        return read_header(Path(job.output_dir) / name).metadata.get("ss_new_sd_model_hash")
    except (OSError, HeaderError):
        return None

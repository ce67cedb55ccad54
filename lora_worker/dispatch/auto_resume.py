"""What follows reconcile for a job a reboot cut off (`auto_resume`): resumed once, or marked resumable.

Reconcile itself only ends rows (it sits beside dispatch, and never imports it); the web process calls
`follow_up` after each of its reconciles, so the start-up one after a reboot finds the jobs the boot's
`lora-worker reconcile` failed `host_rebooted`. Each such job is looked at once (its `resume: ` event says it
was): with `auto_resume` on, a job of its own request (attempt 1) is resumed from its newest good state, and
the events of both say so; a resume that a reboot cut off in turn is never resumed by itself (a resume's
failures must not loop), nor is anything with `auto_resume` off: the event then says whether a client's
POST /train/<id>/resume would be accepted, and from which step.
"""
from __future__ import annotations

import logging

from lora_worker.dispatch.dispatcher import Dispatcher
from lora_worker.dispatch.resumable import verdict
from lora_worker.dispatch.resume import resume
from lora_worker.errors import LaunchFailed, LoraWorkerError
from lora_worker.ledger import resumes
from lora_worker.ledger.models import Job

log = logging.getLogger(__name__)
AUTO_RESUME_MAX_ATTEMPT = 1  # only a job of its own request is resumed automatically, and once
# A resume whose launch failed ran no trainer and counts as no resume (resumes.resume_of): it is tried again at
# the next reconcile, this many launches in all, then left to a client, so a launch that cannot succeed (a broken
# sandbox, a full disk) does not add a failed row every few seconds.
AUTO_RESUME_LAUNCH_TRIES = 3
ACTOR = "reconcile"


def follow_up(dispatcher: Dispatcher) -> list[int]:
    """Look at each cut-off job not looked at yet; the ids of the resumes started."""
    started = []
    for job in resumes.cut_off_unlooked(dispatcher.db):
        try:
            new = _follow(dispatcher, job)
        except LoraWorkerError:
            raise  # the ledger is busy or gone: nothing can be noted, the next follow-up looks again
        except Exception as exc:  # noqa: BLE001 - contained to this job: noted as looked at, so logged once
            log.exception("job %s: its follow-up after the reboot failed", job.id, extra={"job": job.id})
            _note(dispatcher, job, f"not looked at: the follow-up failed ({type(exc).__name__}: {exc}); "
                                   f"GET /train/{job.id}/resume says whether it can be resumed")
            continue
        if new is not None:
            started.append(new)
    return started


def _follow(dispatcher: Dispatcher, job: Job) -> int | None:
    found = verdict(dispatcher.db, dispatcher.settings, job)
    why = "; ".join(f"{p.code}: {p.message}" for p in found.reasons[:3])
    if not found.resumable:
        _note(dispatcher, job, f"not resumable ({why})")
        return None
    where = f"from step {found.from_step} ({found.state})"
    if not dispatcher.settings.auto_resume:
        _note(dispatcher, job, f"resumable {where}: POST /train/{job.id}/resume (auto_resume is off)")
        return None
    if job.attempt > AUTO_RESUME_MAX_ATTEMPT:
        _note(dispatcher, job, f"resumable {where}, but attempt {job.attempt} is itself a resume: never resumed "
                               "automatically")
        return None
    try:
        new, _ = resume(dispatcher, job.id, actor=ACTOR)
    except LaunchFailed as exc:  # no trainer ran: no resume happened, so the next follow-up tries again
        tries = resumes.launches_failed(dispatcher.db, job.id)
        if tries < AUTO_RESUME_LAUNCH_TRIES:
            resumes.note(dispatcher.db, job.id, actor=ACTOR, reason=f"auto_resume {where}: launch {tries} of "
                         f"{AUTO_RESUME_LAUNCH_TRIES} failed ({exc.message}); tried again at the next reconcile")
        else:
            _note(dispatcher, job, f"auto_resume {where} not started: its {tries} launches failed, the last: "
                                   f"{exc.message}; left to a client (POST /train/{job.id}/resume)")
        return None
    except LoraWorkerError as exc:  # busy (another job), or refused now: said, and left to a client
        _note(dispatcher, job, f"auto_resume {where} not started: {exc.code}: {exc.message}")
        return None
    _note(dispatcher, job, f"auto_resume: resumed as job {new.id} {where}")
    log.warning("job %s: the reboot cut it off; auto_resume resumed it as job %s %s", job.id, new.id, where)
    return new.id


def _note(dispatcher: Dispatcher, job: Job, text: str) -> None:
    resumes.note(dispatcher.db, job.id, actor=ACTOR, reason=resumes.NOTE_PREFIX + text)

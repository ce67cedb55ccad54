"""The scenarios of a job's life, each a function of a worker of any backend (tests/helpers/life.py) that runs the
job and asserts its one expected end: tests/contract/test_job_life.py runs each on the local supervisor and on Slurm
through the fake tools, tests/cluster/test_job_life.py a few on the real single-node cluster."""
from __future__ import annotations

import hashlib
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from lora_worker.ledger import outbox
from lora_worker.ledger import repository as repo
from tests.helpers.life import TO_TRAINING, End, Worker, end_of, hooks, phase_hooks, phases
from tests.helpers.runs import wait_states_removed

Start = Callable[..., Worker]
LORA = "ohwx_lora.safetensors"
PARTIAL = f"{LORA}.partial-<id>"
SAVED = (100, 200, 300, 400)  # the step saves of the fast tier, the last step's among them
STEPS = tuple(f"ohwx_lora-step{s:08d}.safetensors" for s in SAVED)  # each sampled step LoRA is kept
SAMPLE_DIR = "sample"
# The sample passes (one prompt: the request's default): before the first step, then one before each step save,
# each tied to the step LoRA saved right after it.
FIRST = (("job.sample", 0, 1, 1, None),)
QUEUED = ((outbox.QUEUED, "queued"),)
STARTED = ((outbox.QUEUED, "queued"), (outbox.STARTED, "running"))
RAN = (("", "queued"), ("queued", "running"))
NEVER = str(Path("/nonexistent") / "release")  # a release file that never comes: the trainer holds its step


def end(status: str, failure: str | None, phase: str | None, *, upto: tuple[str, ...] = TO_TRAINING,
        lora: bool = False, notes: tuple = (), checkpoints: tuple = (), samples: tuple | None = None,
        files: tuple[str, ...] = ()) -> End:
    """The end of a job that ran through the phases `upto` (its pass before the first step over once it trained,
    unless `samples` says which passes; the sample folder there once a pass began)."""
    samples = (FIRST if "training" in upto else ()) if samples is None else samples
    files = files + ((SAMPLE_DIR,) if "sampling" in upto and SAMPLE_DIR not in files else ())
    return End(status, failure, phase, lora, RAN + phases(*upto) + notes + (("running", status),),
               STARTED + phase_hooks(*upto) + ((f"job.{status}", status, failure, lora, lora),)
               + tuple(sorted(checkpoints + samples)), tuple(sorted(files)))


SAVES = ("sampling", "saving", "training") * 4 + ("saving",)  # each step save after its pass, then the final save
STEP_LORAS = tuple(("job.checkpoint", s, True, False) for s in SAVED)
PASSES = FIRST + tuple(("job.sample", s, 1, 1, (s, True)) for s in SAVED)
# Kept for a resume only where one can follow (a failure cut off from outside: states.RESUMABLE); a success, a
# client's cancel and a failure a resume would meet again drop them once the end is written.
STATES = ("ohwx_lora-state", "ohwx_lora-step00000400-state")
MOVED = (("note", "LoRA moved aside"),)
ASKED = (("note", "cancel requested"),)  # the client's cancel, on the row before the job ends
SUCCESS = end("succeeded", None, "saving", upto=TO_TRAINING + SAVES, lora=True, checkpoints=STEP_LORAS,
              samples=PASSES, files=(*STEPS, LORA, SAMPLE_DIR))


def held(worker: Worker, job_id: int, step: int) -> None:
    worker.wait(job_id, f"step {step}", lambda j: j["step"] >= step and j["status"] == "running")


# -- a run ------------------------------------------------------------------------------------------------------

def success(worker: Worker) -> None:
    worker.modes()
    job_id = worker.submit()
    worker.wait_end(job_id)
    wait_states_removed(Path(worker.job(job_id)["output_dir"]))
    assert end_of(worker, job_id) == SUCCESS
    assert worker.job(job_id)["step"] == 400


def samples_listed_and_promoted(worker: Worker) -> None:
    """Two prompts: every pass's images listed with the step LoRA of their step (the follower found them in the
    sample folder: no log line names them), one job.sample per pass, the contact sheet, and the step LoRA of step
    200 promoted to the result with its job.promoted event."""
    worker.modes()
    job_id = worker.submit(samples=[{"prompt": "photo of ohwx woman"}, {"prompt": "ohwx woman, red coat", "seed": 9}])
    worker.wait_end(job_id)
    row = worker.job(job_id)
    assert row["status"] == "succeeded", row
    listed = worker.client.get(f"/train/{job_id}/samples").get_json()["images"]
    loras = {c["step"]: c["sha256"] for c in row["checkpoints"]}
    assert [(i["step"], i["prompt_index"], i["seed"]) for i in listed] == [
        (s, p, seed) for s in (0, *SAVED) for p, seed in ((0, 42), (1, 9))]
    assert all(i["lora"]["sha256"] == loras[i["step"]] and i["lora"]["verified"] for i in listed if i["step"])
    served = worker.client.get(f"/train/{job_id}/samples/{listed[-1]['name']}")
    assert hashlib.sha256(served.data).hexdigest() == listed[-1]["sha256"]
    assert worker.client.get(f"/train/{job_id}/samples.png").mimetype == "image/png"
    passes = [h for h in hooks(worker, job_id) if h[0] == "job.sample"]
    assert sorted(passes) == [("job.sample", 0, 2, 2, None)] + [("job.sample", s, 2, 2, (s, True)) for s in SAVED]
    promoted = worker.client.post(f"/train/{job_id}/promote", json={"step": 200})
    assert promoted.status_code == 200 and promoted.get_json()["lora_sha256"] == loras[200]
    assert worker.job(job_id)["lora_path"].endswith("ohwx_lora-step00000200.safetensors")
    assert hooks(worker, job_id)[-1] == ("job.promoted", "succeeded")


def nan_loss(worker: Worker) -> None:
    """A NaN loss at step 5: the run is stopped (the trainer would go on to save a LoRA of NaN weights whose header
    verifies) and fails nan_loss."""
    worker.modes(nan_from_step=5, hold_at_step=20, release_file=NEVER)
    job_id = worker.submit()
    row = worker.wait_end(job_id)
    assert end_of(worker, job_id) == end("failed", "nan_loss", "training")
    assert row["error"].startswith("The loss became NaN at step 5") and 5 <= row["step"] < 20


def stall(worker: Worker, phase: str, modes: dict[str, Any]) -> None:
    """The trainer falls silent in `phase` (its worker's limit there is short): stopped, failed stalled."""
    worker.modes(**modes)
    job_id = worker.submit()
    row = worker.wait_end(job_id)
    upto = TO_TRAINING[:TO_TRAINING.index(phase) + 1]
    assert end_of(worker, job_id) == end("failed", "stalled", phase, upto=upto)
    assert f"No progress in phase {phase} within its limit" in row["error"]


# -- a client's cancel, in each phase ---------------------------------------------------------------------------

def cancel_queued(worker: Worker) -> None:
    """Its worker keeps jobs queued (no supervisor starts locally, Slurm keeps them PENDING)."""
    worker.modes()
    job_id = worker.submit()
    worker.cancel(job_id)
    worker.wait_end(job_id)
    # The one difference of the backends: a local queued job is cancelled at once (nothing has started it), a
    # Slurm one is flagged (a node may start it any moment) and cancelled once Slurm says it ended.
    done = end_of(worker, job_id)
    assert (ASKED[0] in done.events) == (worker.backend != "local")
    assert replace(done, events=tuple(e for e in done.events if e not in ASKED)) == End(
        "cancelled", None, None, False, (("", "queued"), ("queued", "cancelled")),
        QUEUED + (("job.cancelled", "cancelled", None, False, False),), ())


def cancel_running(worker: Worker, phase: str, modes: dict[str, Any]) -> None:
    worker.modes(**modes)
    job_id = worker.submit()
    worker.wait_phase(job_id, phase)
    worker.cancel(job_id)
    worker.wait_end(job_id)
    upto = TO_TRAINING[:TO_TRAINING.index(phase) + 1]
    assert end_of(worker, job_id) == end("cancelled", None, phase, upto=upto, notes=ASKED)


def cancel_saving(worker: Worker) -> None:
    """A cancel while the final LoRA is half written: cancelled, the half file set aside, the states (the last
    step's and the end's, both written by then) removed: a cancel is never resumed."""
    worker.modes(partial_save_then_hang=True)
    job_id = worker.submit()
    lora = Path(worker.job(job_id)["output_dir"]) / LORA
    # Step 400 has a step save of its own (phase saving too) before the final save: the row may say saving at 400
    # with the half file already written while the final save's phases are not yet on the row, and the cancel's note
    # would then come before them. So the wait is for the final save's phase, the last of SAVES.
    final_save = SAVES.count("saving")
    worker.wait(job_id, "half a LoRA, in the final save", lambda j: j["phase"] == "saving" and j["step"] == 400
                and lora.exists() and sum(e.reason == "phase saving" for e in repo.job_events(worker.db, job_id))
                == final_save)
    assert {p.name for p in lora.parent.iterdir()} >= set(STATES)
    worker.cancel(job_id)
    worker.wait_end(job_id)
    wait_states_removed(lora.parent)
    assert end_of(worker, job_id) == end("cancelled", None, "saving", upto=TO_TRAINING + SAVES, notes=ASKED + MOVED,
                                         checkpoints=STEP_LORAS, samples=PASSES, files=(*STEPS, PARTIAL, SAMPLE_DIR))


def cancel_after_a_state(worker: Worker) -> None:
    """A cancel in training after the run saved its state of step 100: cancelled, the state removed with it (it
    can serve no resume), the step LoRA and the samples kept."""
    worker.modes(hold_at_step=200, release_file=NEVER)
    job_id = worker.submit()
    output = Path(worker.job(job_id)["output_dir"])
    held(worker, job_id, 199)
    assert "ohwx_lora-step00000100-state" in {p.name for p in output.iterdir()}
    worker.cancel(job_id)
    worker.wait_end(job_id)
    wait_states_removed(output)
    assert end_of(worker, job_id) == end("cancelled", None, "training", upto=TO_TRAINING + SAVES[:3], notes=ASKED,
                                         checkpoints=STEP_LORAS[:1], samples=PASSES[:2], files=(STEPS[0],))


# -- the trainer's own endings ---------------------------------------------------------------------------------

def crash(worker: Worker) -> None:
    worker.modes(crash_at_step=3)
    job_id = worker.submit()
    row = worker.wait_end(job_id)
    assert end_of(worker, job_id) == end("failed", "trainer_crashed", "training")
    assert row["exit_code"] == 1 and "CUDA error: an illegal memory access" in row["error"]


def crash_after_a_state(worker: Worker) -> None:
    """The trainer's own exception after its state of step 100: trainer_crashed, which a resume would meet again
    (the same code on the same state), so the state goes with the end; the step LoRA and the samples stay."""
    worker.modes(crash_at_step=200)
    job_id = worker.submit()
    worker.wait_end(job_id)
    wait_states_removed(Path(worker.job(job_id)["output_dir"]))
    assert end_of(worker, job_id) == end("failed", "trainer_crashed", "training", upto=TO_TRAINING + SAVES[:3],
                                         checkpoints=STEP_LORAS[:1], samples=PASSES[:2], files=(STEPS[0],))


def no_lora(worker: Worker) -> None:
    """Exit 0 without a LoRA: no_output, which a resume would meet again: its state goes."""
    worker.modes(skip_save=True)
    job_id = worker.submit()
    worker.wait_end(job_id)
    wait_states_removed(Path(worker.job(job_id)["output_dir"]))
    assert end_of(worker, job_id) == end("failed", "no_output", "training", upto=TO_TRAINING + SAVES[:-1],
                                         checkpoints=STEP_LORAS, samples=PASSES, files=(*STEPS, SAMPLE_DIR))


def save_never_ends(worker: Worker) -> None:
    """The final save hangs half written (a full disk, a hung mount; its worker's saving limit is short): stopped,
    stalled; the half file is moved aside, so the same request again is accepted, not 422 output_exists. A stall
    may be resumed: its states stay."""
    worker.modes(partial_save_then_hang=True)
    job_id = worker.submit()
    worker.wait_end(job_id)
    assert end_of(worker, job_id) == end("failed", "stalled", "saving", upto=TO_TRAINING + SAVES, notes=MOVED,
                                         checkpoints=STEP_LORAS, samples=PASSES,
                                         files=(*STATES, *STEPS, PARTIAL, SAMPLE_DIR))
    worker.modes(hang_in="launching")
    again = worker.submit()  # 202, not output_exists
    worker.cancel(again)
    worker.wait_end(again)


def step_lora_unverified(worker: Worker) -> None:
    worker.modes(step_metadata_overrides={"ss_steps": "7"})  # each step LoRA names the wrong step
    job_id = worker.submit()
    worker.wait_end(job_id)
    wait_states_removed(Path(worker.job(job_id)["output_dir"]))
    unverified = tuple(("job.checkpoint", s, False, True) for s in SAVED)
    passes = FIRST + tuple(("job.sample", s, 1, 1, (s, False)) for s in SAVED)  # each names its step LoRA's verdict
    assert end_of(worker, job_id) == end("succeeded", None, "saving", upto=TO_TRAINING + SAVES, lora=True,
                                         checkpoints=unverified, samples=passes, files=(*STEPS, LORA, SAMPLE_DIR))
    errors = {c["step"]: c["error"] for c in worker.job(job_id)["checkpoints"]}
    assert errors == {s: f"ss_steps '7' instead of {s}" for s in SAVED}


# -- the follower itself: killed, stopped ----------------------------------------------------------------------

def follower_gone(worker: Worker, sig: int) -> None:
    """`sig` to the job's follower in training: SIGKILL (it dies), SIGTERM (systemd stopping the service). A
    supervisor's job cannot outlive it: killed, the next request's reconcile stops the trainer and fails the job
    supervisor_lost; stopped, the supervisor stops its trainer and fails it supervisor_signalled (never
    cancelled: a new try may pass). A Slurm job runs on without its poller: the next request's reconcile starts a
    poller again, which takes the job up where the log and the row say it is and follows it to its own end.
    Either way each event is sent once, and the run log is only appended to."""
    release = worker.host.root / "release"
    worker.modes(hold_at_step=100, release_file=str(release))
    job_id = worker.submit()
    worker.wait(job_id, "step 99", lambda j: j["step"] >= 99 and j["status"] == "running")
    log_before, hooks_before = worker.log(job_id), hooks(worker, job_id)
    worker.followed_again(job_id, worker.signal_follower(job_id, sig))
    release.touch()
    worker.wait_end(job_id)
    if worker.backend == "local":
        failure = "supervisor_lost" if sig == signal.SIGKILL else "supervisor_signalled"
        assert end_of(worker, job_id) == end("failed", failure, "training")
    else:
        wait_states_removed(Path(worker.job(job_id)["output_dir"]))
        assert end_of(worker, job_id) == SUCCESS
    assert worker.job(job_id)["cancel_requested_at"] is None
    assert_followed_once(worker, job_id, log_before, hooks_before)


def assert_followed_once(worker: Worker, job_id: int, log_before: bytes, hooks_before: list) -> None:
    """What a follower's death never does, on any backend: rewrite the run log (or log a line twice), or send an
    event twice."""
    log = worker.log(job_id)
    assert log.startswith(log_before)
    for line in (b"loading model for process 0/1", b"import network module: networks.lora"):  # each said once
        assert log.count(line) == 1, line
    said = [h for h in hooks(worker, job_id) if h[0] != outbox.PROGRESS]
    before = [h for h in hooks_before if h[0] != outbox.PROGRESS]
    assert said[:len(before)] == before
    once = [h for h in said if h[0] != outbox.PHASE]
    assert len(once) == len(set(once)), said
    assert [h[1] for h in said if h[0] == outbox.PHASE] == [
        e[1] for e in end_of(worker, job_id).events if e[0] == "phase"]

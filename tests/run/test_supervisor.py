"""The detached supervisor, end to end with real processes: the fake `accelerate` → fake trainer tree."""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from lora_worker.host.safetensors import inspect_lora
from lora_worker.dispatch.argv import build_argv, build_env
from lora_worker.dispatch import presentation
from lora_worker.dispatch.presentation import config_for
from lora_worker.run.local import LocalBackend
from lora_worker.dispatch.request import TrainRequest, resolve_request
from lora_worker.ledger import repository as repo
from lora_worker.run.local import launch_supervisor
from tests.helpers import fake_gpus, hold_exclusive, pid_alive, wait_for
from tests.helpers.runs import TERMINAL, job, job_processes, modes, recorded, submit, wait_phase, wait_state

pytestmark = pytest.mark.slow


# -- a run ------------------------------------------------------------------------------------------------------

def test_a_full_run_succeeds_with_a_verified_lora(client, host, db):
    modes(host)
    job_id = submit(client, host)
    done = wait_state(client, job_id, *TERMINAL)
    assert done["status"] == "succeeded", done
    assert (done["step"], done["total_steps"], done["failure_class"], done["exit_code"]) == (400, 400, None, 0)
    lora = Path(done["lora_path"])
    assert lora == host.dataset.parent / "output" / "ohwx_lora.safetensors"
    assert inspect_lora(lora).ranks == {16}
    events = [(e.from_status, e.to_status, e.actor, e.reason if e.from_status == e.to_status else None)
              for e in repo.job_events(db, job_id)]
    # the default prompt's pass before the first step; each step save (at 100, 200, 300 and 400: tier fast saves
    # every 100 steps) after its sample pass, a `saving` and back to `training`; then the final save
    phases = ["loading_model", "caching_latents", "caching_text_encoder_outputs", "preparing_training", "sampling",
              "training", *["sampling", "saving", "training"] * 4, "saving"]
    assert events == [(None, "queued", "api", None), ("queued", "running", "supervisor", None),
                      *(("running", "running", "supervisor", f"phase {p}") for p in phases),
                      ("running", "succeeded", "supervisor", None)]  # every phase passed, in order
    points = repo.progress_points(db, job_id)
    assert points and points[-1].step == 400 and all(p.loss is not None for p in points)
    log = client.get(f"/train/{job_id}/log?lines=5").get_json()["text"]
    assert "model saved." in log and "[lora-worker] trainer ended: exit status 0" in log
    assert_started_as_stored(recorded(host), repo.get_job(db, job_id), host)


def assert_started_as_stored(rec: dict, row, host) -> None:
    """The trainer ran the stored argv with the allow-listed env, in its own group, with nothing inherited."""
    script = row.argv.index(str(host.settings.train_script))
    assert rec["argv"] == row.argv[script:]  # the trainer sees the script and its args exactly as stored
    # the launcher adds OMP_NUM_THREADS and ACCELERATE_MIXED_PRECISION, as the real one does; nothing else leaks
    assert set(rec["env"]) - {"OMP_NUM_THREADS", "ACCELERATE_MIXED_PRECISION"} == set(row.env)
    assert rec["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert rec["pgid"] == row.trainer_pid and rec["ppid"] == row.trainer_pid  # two levels, one group
    # nothing of the web or the supervisor leaks in: stdin is /dev/null, stdout and stderr one pipe, and the
    # only other descriptors are the trainer's own (its record file, /proc/self/fd being listed)
    fds = rec["fds"]
    assert fds["0"] == "/dev/null" and fds["1"] == fds["2"] and fds["1"].startswith("pipe:")
    assert all(path.startswith(("/proc/", str(host.root / "record.json"))) for fd, path in fds.items()
               if fd not in ("0", "1", "2")), fds
    assert rec["umask"] == 0o002  # the LoRA and checkpoints are readable and writable by the shared group


def test_a_running_job_is_followed_by_log_offset_and_shown_as_ours(client, host):
    release = host.root / "release"
    modes(host, hold_at_step=200, release_file=str(release))
    job_id = submit(client, host)
    rec = recorded(host)
    # while it runs: /healthz names it, and /gpu-status marks the trainer's process as ours
    assert client.get("/healthz").get_json()["active_job_id"] == job_id
    fake_gpus(host.gpus, processes1=[{"pid": rec["pid"], "used_mib": 30_000}])
    (proc,) = client.get("/gpu-status").get_json()["devices"][1]["processes"]
    assert (proc["pid"], proc["ours"], proc["tts"]) == (rec["pid"], True, False)
    # a follower passes back the offset it was given, and sees every byte once
    followed, offset = "", 0

    def follow() -> None:
        nonlocal followed, offset
        chunk = client.get(f"/train/{job_id}/log?offset={offset}&limit=4096").get_json()
        assert chunk["skipped"] == 0 and chunk["offset"] == offset + len(chunk["text"].encode())
        followed, offset = followed + chunk["text"], chunk["offset"]
    for _ in range(5):
        follow()
    release.touch()
    wait_state(client, job_id, *TERMINAL)
    while True:  # to the end of the log
        before = offset
        follow()
        if offset == before:
            break
    whole = client.get(f"/train/{job_id}/log?offset=0&limit=1048576").get_json()
    assert followed == whole["text"] and "model saved." in followed
    assert client.get("/healthz").get_json()["active_job_id"] is None
    for bad in ("lines=10001", "lines=-1", "limit=0", "offset=-1", "lines=x"):
        assert client.get(f"/train/{job_id}/log?{bad}").status_code == 422, bad


def test_progress_is_visible_mid_run(client, host):
    modes(host, step_s=0.02)
    job_id = submit(client, host)
    # eta_s stays null until two steps were seen (no history here), so wait for a moment that has one
    mid = wait_for(lambda: (j := job(client, job_id))["status"] == "running" and 5 < j["step"] < 400
                   and j["eta_s"] is not None and j, what="a measured step between 5 and 400")
    assert mid["phase"] == "training" and mid["loss"] is not None and mid["rate"] > 0 and mid["eta_basis"] == "measured"
    later = wait_for(lambda: (j := job(client, job_id))["step"] > mid["step"] and j, what="more steps")
    assert later["version"] > mid["version"]
    client.post(f"/train/{job_id}/cancel")
    wait_state(client, job_id, *TERMINAL)


def test_no_zombies_the_web_reaps_its_launch_and_the_supervisor_reaps_the_job(client, host, db):
    release = host.root / "release"
    modes(host, hold_at_step=399, release_file=str(release))
    job_id = submit(client, host)
    rec = recorded(host)
    # the web's child was only the first of the supervisor's two forks, and it was reaped on return
    assert [c for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE] == []
    supervisor = repo.get_job(db, job_id).supervisor_pid
    # A locked ledger keeps the supervisor alive after the trainer ends (it retries the final write), so
    # what it left behind can be seen: the launcher and the trainer must be reaped, not zombies.
    # Held longer than the wait below, which is long enough for the trainer's end on a loaded machine (3.5 s was
    # not, in a make test beside other suites, 2026-12-06).
    holder = hold_exclusive(db.path, 15.0)
    release.touch()
    wait_for(lambda: not psutil.pid_exists(rec["pgid"]) and not psutil.pid_exists(rec["pid"]), timeout=12,
             what="the launcher and the trainer reaped (gone from the process table)")
    assert pid_alive(supervisor) and psutil.Process(supervisor).children(recursive=True) == []
    holder.join()
    assert wait_state(client, job_id, *TERMINAL)["status"] == "succeeded"


def test_another_trainer_may_take_the_gpu_lock_while_the_supervisor_waits_on_a_locked_ledger(client, host, db):
    from lora_worker.host.locks import gpu_lock_path, take_lock

    release = host.root / "release"
    modes(host, hold_at_step=399, release_file=str(release))
    job_id = submit(client, host)
    rec = recorded(host)
    lock = gpu_lock_path(host.settings, repo.get_job(db, job_id).device_index)
    assert take_lock(lock, 0.0) is None  # the job's, while it trains
    # The last progress write, the LoRA check and the state wait on it. Long enough for the trainer's end (its
    # end state and LoRA written) on a loaded machine: 6 s was not, once the end state came (issue 26).
    holder = hold_exclusive(db.path, 15.0)
    release.touch()
    wait_for(lambda: not psutil.pid_exists(rec["pgid"]) and not psutil.pid_exists(rec["pid"]), timeout=12,
             what="the launcher and the trainer gone")
    fd = wait_for(lambda: take_lock(lock, 0.0), timeout=2.0, what="the GPU lock free while the ledger is locked")
    try:
        assert holder.is_alive() and repo.get_job(db, job_id).status == "running"  # the job has not ended yet
    finally:
        os.close(fd)
    holder.join()
    assert wait_state(client, job_id, *TERMINAL)["status"] == "succeeded"


# -- failures -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, failure, text", [
    ({"oom_at_step": 3}, "cuda_oom", "CUDA out of memory"),
    ({"crash_at_step": 2}, "trainer_crashed", "illegal memory access"),
    ({"skip_save": True}, "no_output", "no LoRA was saved"),
    ({"rank_override": 8}, "artifact_mismatch", "rank [8] instead of 16"),
    ({"metadata_overrides": {"ss_seed": "7"}}, "artifact_mismatch", "ss_seed '7' instead of 42"),
])
def test_failure_classes_of_real_runs(client, host, mode, failure, text):
    modes(host, step_s=0.001, **mode)  # how fast the 400 steps go changes nothing of how the run ends
    done = wait_state(client, submit(client, host), *TERMINAL)
    assert (done["status"], done["failure_class"]) == ("failed", failure), done
    assert text in done["error"] and done["lora_path"] is None


def test_a_trainer_killed_by_the_kernel_is_killed_by_signal(client, host):
    modes(host, hang_in="training")
    job_id = submit(client, host)
    rec = recorded(host)
    wait_phase(client, job_id, "training")
    os.kill(rec["pid"], signal.SIGKILL)  # what the OOM killer does; the launcher survives and reports it
    done = wait_state(client, job_id, *TERMINAL)
    assert (done["failure_class"], done["signal"], done["exit_code"]) == ("killed_by_signal", 9, 1)


def test_a_dataset_broken_after_acceptance_is_dataset_invalid(client, host):
    modes(host, launcher_delay_s=1.0)
    job_id = submit(client, host)
    (host.dataset / "10_ohwx woman" / "img1.txt").write_bytes(b"")  # the trainer has not read it yet
    done = wait_state(client, job_id, *TERMINAL)
    assert (done["failure_class"], done["exit_code"]) == ("dataset_invalid", 1)
    assert "caption file is empty" in done["error"]


@pytest.mark.own_tokenizers  # it breaks its host's tokenizers
def test_tokenizers_removed_after_acceptance_is_tokenizer_missing(client, host):
    modes(host, launcher_delay_s=1.0)
    job_id = submit(client, host)
    for d in host.settings.tokenizer_cache_dir.iterdir():
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    assert wait_state(client, job_id, *TERMINAL)["failure_class"] == "tokenizer_missing"


def start_stored_job(host, db, *, extra: tuple[str, ...] = (), **request: object) -> int:
    """Record and launch a job whose argv the API would never build (a changed trainer, a vanished model)."""
    values = dict(dataset_dir=str(host.dataset), base_model_path=str(host.model),
                  output_dir=str(host.dataset.parent / "output"), output_name="ohwx_lora", trigger="ohwx",
                  subject_class="woman", repeats=10, tier="fast", device_index=1, seed=42)
    values.update(request)
    req = resolve_request(TrainRequest(**values), train_id="t1",  # type: ignore[arg-type]
                          **{k: Path(str(values[k])) for k in ("dataset_dir", "base_model_path", "output_dir")})
    config = config_for(req, host.settings, LocalBackend(), 3)
    presentation.write(config)
    argv = build_argv(req, host.settings, LocalBackend(), config) + list(extra)
    job = repo.create_job(db, {**req.row_columns(), "image_count": 3, "argv": argv,
                               "env": build_env(req, host.settings, LocalBackend())})
    Path(req.output_dir).mkdir(parents=True, exist_ok=True)  # as dispatch does; the pre-exec check wants it
    launch_supervisor(job.id, host.settings)
    return job.id


@pytest.mark.parametrize("change, failure", [
    ({"extra": ("--text_encoder_lr1=1e-5",)}, "invalid_arguments"),
    ({"base_model_path": "/nonexistent/model.safetensors"}, "model_load_error"),
])
def test_failures_only_a_changed_installation_can_cause(client, host, db, change, failure):
    modes(host)
    job_id = start_stored_job(host, db, **change)
    done = wait_state(client, job_id, *TERMINAL)
    assert (done["status"], done["failure_class"], done["exit_code"]) == ("failed", failure, 1)


def test_no_images_with_exit_0_is_not_success(client, host, db):
    modes(host)
    empty = host.root / "train" / "t1" / "empty"
    (empty / "10_ohwx woman").mkdir(parents=True)  # the kohya folder, with nothing in it
    done = wait_state(client, start_stored_job(host, db, dataset_dir=str(empty)), *TERMINAL)
    assert (done["status"], done["failure_class"], done["exit_code"]) == ("failed", "dataset_invalid", 0)
    assert "No data found" in done["error"]


# -- cancel -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("phase", ["launching", "training"])
def test_cancel_leaves_nothing_alive(client, host, db, phase):
    modes(host, hang_in=phase)
    job_id = submit(client, host)
    rec = recorded(host)
    wait_phase(client, job_id, phase)
    assert client.post(f"/train/{job_id}/cancel").status_code == 202
    done = wait_state(client, job_id, *TERMINAL, timeout=15)
    assert (done["status"], done["failure_class"], done["lora_path"]) == ("cancelled", None, None)
    assert job_processes(rec) == []
    assert [e.to_status for e in repo.job_events(db, job_id)][-1] == "cancelled"


def test_cancel_escalates_to_sigkill_for_a_trainer_that_ignores_sigterm(client, host):
    modes(host, hang_in="training", ignore_sigterm=True)
    job_id = submit(client, host)
    rec = recorded(host)
    wait_phase(client, job_id, "training")
    started = time.monotonic()
    client.post(f"/train/{job_id}/cancel")
    done = wait_state(client, job_id, *TERMINAL, timeout=15)
    took = time.monotonic() - started
    assert done["status"] == "cancelled" and job_processes(rec) == []
    assert host.settings.cancel_grace_s <= took < host.settings.cancel_grace_s + 5
    log = client.get(f"/train/{job_id}/log?lines=20").get_json()["text"]
    assert "SIGTERM to process group" in log and "SIGKILL" in log


def test_cancel_kills_a_grandchild_that_escaped_the_group_and_ignores_sigterm(client, host):
    modes(host, hang_in="training", grandchild="session", grandchild_ignores_sigterm=True)
    job_id = submit(client, host)
    rec = recorded(host)
    assert rec["grandchild"] and pid_alive(rec["grandchild"])
    wait_phase(client, job_id, "training")
    client.post(f"/train/{job_id}/cancel")
    assert wait_state(client, job_id, *TERMINAL, timeout=15)["status"] == "cancelled"
    assert job_processes(rec) == []


def test_cancelling_twice_is_harmless_and_a_finished_job_is_a_409(client, host):
    # A trainer that outlasts the TERM (until the grace's KILL): the job is still active at the second cancel,
    # however slow that request is on a loaded machine.
    modes(host, hang_in="training", ignore_sigterm=True)
    job_id = submit(client, host)
    wait_phase(client, job_id, "training")
    first, second = client.post(f"/train/{job_id}/cancel"), client.post(f"/train/{job_id}/cancel")
    assert first.status_code == second.status_code == 202
    assert first.get_json()["cancel_requested_at"] == second.get_json()["cancel_requested_at"]
    wait_state(client, job_id, *TERMINAL)
    late = client.post(f"/train/{job_id}/cancel")
    assert late.status_code == 409 and late.get_json()["error"] == "job_finished"


def test_cancel_racing_the_natural_end_gives_exactly_one_terminal_state(client, host, db):
    rng = random.Random(1234)
    for i in range(4):
        modes(host)
        job_id = submit(client, host, output_name=f"race{i}")
        time.sleep(rng.uniform(0.5, 3.0))
        client.post(f"/train/{job_id}/cancel")  # 202 while running, 409 once it ended: both fine
        done = wait_state(client, job_id, *TERMINAL)
        terminal_events = [e for e in repo.job_events(db, job_id) if e.to_status in TERMINAL]
        assert len(terminal_events) == 1 and terminal_events[0].to_status == done["status"]
        time.sleep(0.3)
        assert job(client, job_id)["status"] == done["status"]  # never reverted


def test_a_nan_loss_stops_a_real_run_and_fails_it_nan_loss(client, host):
    modes(host, nan_from_step=50, step_s=0.01)
    job_id = submit(client, host)
    rec = recorded(host)
    done = wait_state(client, job_id, *TERMINAL, timeout=30)
    assert (done["status"], done["failure_class"], done["lora_path"]) == ("failed", "nan_loss", None)
    assert done["error"].startswith("The loss became NaN at step 50") and done["step"] < 400
    assert job_processes(rec) == []


@pytest.mark.parametrize("end", ["cancel", "kill"])
def test_a_partial_lora_of_a_failed_save_is_moved_aside_and_blocks_no_retry(client, host, db, end):
    """A cancel or a kill (the OOM killer) during `saving` leaves half a file: no finished LoRA. It is moved
    aside (kept, said in the job's events), and the same request sent again is accepted, not output_exists."""
    modes(host, partial_save_then_hang=True, step_s=0.001)
    job_id = submit(client, host)
    rec = recorded(host)
    lora = host.dataset.parent / "output" / "ohwx_lora.safetensors"
    wait_for(lambda: lora.exists() and job(client, job_id)["phase"] == "saving", what="half a LoRA, saving")
    if end == "cancel":
        assert client.post(f"/train/{job_id}/cancel").status_code == 202
    else:
        os.kill(rec["pid"], signal.SIGKILL)
    done = wait_state(client, job_id, *TERMINAL, timeout=15)
    assert done["status"] == ("cancelled" if end == "cancel" else "failed") and done["lora_path"] is None
    aside = lora.with_name(f"ohwx_lora.safetensors.partial-{job_id}")
    assert not lora.exists() and aside.stat().st_size > 0  # moved, never deleted
    notes = [e.reason for e in repo.job_events(db, job_id) if e.from_status == e.to_status == "running"]
    assert any(f"moved aside to {aside.name}" in (n or "") for n in notes)
    assert f"moved aside to {aside.name}" in client.get(f"/train/{job_id}/log?lines=20").get_json()["text"]
    modes(host)
    retry = submit(client, host)  # 202: the partial file blocks nothing
    assert wait_state(client, retry, *TERMINAL)["status"] == "succeeded" and aside.exists()
    again = client.post("/train", json=host.payload())  # a finished, verified LoRA is never overwritten
    assert again.status_code == 422 and again.get_json()["error"] == "output_exists"


# -- supervisor death ------------------------------------------------------------------------------------------

def test_sigterm_to_a_real_supervisor_fails_the_job_supervisor_signalled_never_cancelled(client, host, db):
    """What systemd's final sweep at an orderly reboot does (or `systemctl kill`): nobody cancelled."""
    modes(host, hang_in="training")
    job_id = submit(client, host)
    rec = recorded(host)
    wait_phase(client, job_id, "training")
    supervisor = repo.get_job(db, job_id).supervisor_pid
    os.kill(supervisor, signal.SIGTERM)
    done = wait_state(client, job_id, *TERMINAL, timeout=15)
    assert (done["status"], done["failure_class"]) == ("failed", "supervisor_signalled")
    assert done["error"].startswith("The supervisor received SIGTERM, which was no client's cancel")
    assert done["cancel_requested_at"] is None
    wait_for(lambda: job_processes(rec) == [] and not pid_alive(supervisor), timeout=5, what="job gone")



def test_kill_9_of_the_supervisor_fails_the_job_and_leaves_no_trainer(client, host, db):
    modes(host, hang_in="training", grandchild="group")
    job_id = submit(client, host)
    rec = recorded(host)
    wait_phase(client, job_id, "training")
    supervisor = repo.get_job(db, job_id).supervisor_pid
    os.kill(supervisor, signal.SIGKILL)
    wait_for(lambda: not pid_alive(supervisor), what="supervisor gone")
    done = job(client, job_id)  # the next request reconciles
    assert (done["status"], done["failure_class"]) == ("failed", "supervisor_lost")
    wait_for(lambda: job_processes(rec) == [], timeout=5, what="trainer group gone")

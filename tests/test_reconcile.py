"""Reconcile: no phantom "running" job, and never a signal to a process that is not provably ours."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from lora_worker.ledger import repository as repo
from lora_worker.reconcile import reconcile
from lora_worker.host import processes
from lora_worker.host.locks import hold_lock, job_lock_path
from tests.helpers import pid_alive
from tests.helpers.ledger import columns
from tests.helpers.ledger import running_job


@pytest.fixture
def stranger():
    """An unrelated live process in its own group, as a reused pid would be."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_a_running_row_whose_supervisor_is_gone_becomes_failed(db, migrated):
    job_id = running_job(db, boot_id=processes.boot_id(), supervisor_pid=999_999)
    actions = reconcile(db, migrated)
    assert [(a.job_id, a.failure_class.value) for a in actions] == [(job_id, "supervisor_lost")]
    row = repo.get_job(db, job_id)
    assert (row.status, row.failure_class) == ("failed", "supervisor_lost") and row.finished_at is not None
    assert repo.job_events(db, job_id)[-1].actor == "reconcile"


@pytest.mark.slow
def test_a_forged_row_with_a_reused_pid_never_gets_the_stranger_killed(db, migrated, stranger):
    ticks = processes.start_ticks(stranger.pid)
    job_id = running_job(db, boot_id=processes.boot_id(), supervisor_pid=stranger.pid,
                         trainer_pid=stranger.pid, trainer_start_ticks=ticks - 1)  # same pid, other process
    actions = reconcile(db, migrated)
    assert [a.killed for a in actions] == [()]
    assert repo.get_job(db, job_id).status == "failed"
    time.sleep(0.1)
    assert pid_alive(stranger.pid)


@pytest.mark.slow
def test_a_leftover_trainer_that_is_provably_ours_is_killed(db, migrated, stranger):
    ticks = processes.start_ticks(stranger.pid)
    running_job(db, boot_id=processes.boot_id(), trainer_pid=stranger.pid, trainer_start_ticks=ticks)
    actions = reconcile(db, migrated)
    assert actions[0].killed == (stranger.pid,)
    assert stranger.wait(5) == -signal.SIGKILL


@pytest.mark.slow
def test_a_row_from_before_a_reboot_is_host_rebooted_and_nothing_is_signalled(db, migrated, stranger):
    ticks = processes.start_ticks(stranger.pid)
    job_id = running_job(db, boot_id="00000000-dead-beef-0000-000000000000", trainer_pid=stranger.pid,
                         trainer_start_ticks=ticks)
    reconcile(db, migrated)
    assert repo.get_job(db, job_id).failure_class == "host_rebooted"
    assert pid_alive(stranger.pid)


def test_a_job_whose_supervisor_holds_its_lock_is_left_alone(db, migrated):
    job_id = running_job(db, boot_id=processes.boot_id())
    fd = hold_lock(job_lock_path(migrated, job_id))
    try:
        assert reconcile(db, migrated) == []
        assert repo.get_job(db, job_id).status == "running"
    finally:
        os.close(fd)
    assert [a.job_id for a in reconcile(db, migrated)] == [job_id]


def test_a_queued_row_gets_a_launch_grace_then_fails(db, migrated):
    job = repo.create_job(db, columns())
    assert reconcile(db, migrated) == []  # being launched right now
    time.sleep(migrated.launch_grace_s + 0.1)
    assert [a.failure_class.value for a in reconcile(db, migrated)] == ["supervisor_lost"]
    assert "never started" in (repo.get_job(db, job.id).error or "")


def test_reconcile_is_idempotent(db, migrated):
    running_job(db, boot_id=processes.boot_id())
    first = reconcile(db, migrated)
    snapshot = [(j.id, j.status, j.version) for j in repo.list_jobs(db)]
    assert len(first) == 1 and reconcile(db, migrated) == []
    assert [(j.id, j.status, j.version) for j in repo.list_jobs(db)] == snapshot


@pytest.mark.slow
def test_a_zombie_does_not_count_as_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = processes.identity_of(child.pid)
    assert ident is not None
    time.sleep(0.5)  # exited, not yet reaped: a zombie
    assert processes.state_of(child.pid) == "Z" and not processes.matches(ident)
    child.wait()


def test_the_cli_reconciles_at_start_up(db, migrated, monkeypatch, capsys):
    from lora_worker.ops import cli
    running_job(db, boot_id=processes.boot_id())
    monkeypatch.setattr(cli, "load_settings", lambda: migrated)
    assert cli.main(["reconcile"]) == 0
    assert "1 job(s) marked failed" in capsys.readouterr().out


def test_gpu_status_never_shows_a_dead_supervisors_job_as_active(db, migrated):
    from lora_worker import create_app

    app = create_app(migrated)  # its start-up reconcile has run: the row below is newer than that
    try:
        job_id = running_job(db, boot_id=processes.boot_id(), supervisor_pid=999_999)
        body = app.test_client().get("/gpu-status").get_json()
        assert body["active_job_id"] is None
        assert repo.get_job(db, job_id).failure_class == "supervisor_lost"
    finally:
        app.extensions["lora_worker"].db.dispose()


# -- it says what it killed, and only that ------------------------------------------------------------------------

@pytest.mark.slow
def test_a_job_with_nothing_left_says_so_and_claims_no_kill(db, migrated):
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    ticks = processes.start_ticks(gone.pid)
    gone.wait()
    job_id = running_job(db, boot_id=processes.boot_id(), trainer_pid=gone.pid, trainer_start_ticks=ticks)
    (action,) = reconcile(db, migrated)
    error = repo.get_job(db, job_id).error or ""
    assert action.killed == () and "no process of the job was left" in error and "killed" not in error


@pytest.mark.slow
def test_a_process_it_did_not_kill_is_never_reported_as_killed(db, migrated):
    # Shows our output dir in its argv, but started before the trainer: not provably ours, so not signalled,
    # and so not in the list of what was killed.
    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--output_dir=/train/t1/output"],
                             start_new_session=True)
    try:
        time.sleep(0.05)  # a few clock ticks: the trainer below starts later
        leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        job_id = running_job(db, boot_id=processes.boot_id(), trainer_pid=leader.pid,
                             trainer_start_ticks=processes.start_ticks(leader.pid))
        with db.write() as s:  # the argv that names the output dir
            s.get(type(repo.get_job(db, job_id)), job_id).argv = ["accelerate", "--output_dir=/train/t1/output"]
        (action,) = reconcile(db, migrated)
        assert action.killed == (leader.pid,) and leader.wait(5) == -signal.SIGKILL
        assert pid_alive(older.pid)
        assert f"killed its leftover processes [{leader.pid}]" in (repo.get_job(db, job_id).error or "")
    finally:
        older.kill()
        older.wait()


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.slow
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "unrecorded"])
def test_a_sandboxed_job_whose_launcher_outlived_its_supervisor_is_killed_namespace_and_all(db, migrated, recorded,
                                                                                          tokens):
    # The instant between bwrap's start and its parent-death signal: the supervisor is gone, bwrap is not; and
    # it may have died before it wrote bwrap's pid (then bwrap is found by the job's argv, which it carries).
    marker = f"lora-worker-reconcile-escapee-{id(db)}"
    hider = (f"import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    os.execv(sys.executable, "
             f"[sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\ntime.sleep(60)\n")
    bwrap = subprocess.Popen(["bwrap", "--unshare-pid", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
                              "--dev", "/dev", "--", sys.executable, "-c", hider, *tokens], start_new_session=True)
    try:
        def escapee() -> int | None:
            return next((p for p in psutil.pids() if marker in " ".join(_cmdline(p))), None)
        from tests.helpers import wait_for
        hidden = wait_for(escapee, what="the escapee")
        trainer = {"trainer_pid": bwrap.pid, "trainer_start_ticks": processes.start_ticks(bwrap.pid)}
        job_id = running_job(db, boot_id=processes.boot_id(), supervisor_start_ticks=processes.start_ticks(os.getpid()),
                             **(trainer if recorded else {}))
        _named_argv(db, job_id, tokens)
        (action,) = reconcile(db, migrated)
        assert hidden in action.killed and bwrap.pid in action.killed
        assert not pid_alive(hidden)  # gone when the row is failed
        assert str(hidden) in (repo.get_job(db, job_id).error or "")
    finally:
        bwrap.kill()
        bwrap.wait()


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def test_reconcile_closes_the_run_log_with_what_it_found_and_did(db, migrated):
    from lora_worker.transcript.logfile import JobLog
    from lora_worker.transcript.logreader import LogReader

    job_id = running_job(db, boot_id=processes.boot_id(), supervisor_pid=999_999)
    log = JobLog(migrated.log_dir, job_id, head_bytes=migrated.log_head_bytes, tail_bytes=migrated.log_tail_bytes)
    log.note("job started")
    log.feed("steps:  10%|#         | 40/400 [00:20<03:00, avr_loss=0.1]\nboom\n")
    log.close()  # the supervisor died here: nobody wrote how the run ended
    reconcile(db, migrated, actor="startup")
    lines = LogReader(migrated.log_dir, job_id).tail_lines(3).text.splitlines()
    assert lines[-2] == "boom"
    assert lines[-1] == ("[lora-worker] reconcile (startup): The supervisor died; no process of the job was left; "
                         "the job is failed (supervisor_lost)")
    assert "boom" in repo.get_job(db, job_id).error  # the failed row quotes the log as it was


def test_a_job_whose_supervisor_never_started_gets_a_run_log_saying_so(db, migrated):
    from lora_worker.transcript.logreader import LogReader

    from datetime import timedelta

    from lora_worker.ledger.models import Job, utcnow

    job = repo.create_job(db, columns())
    with db.write() as s:  # queued longer than the launch grace, and never picked up
        s.get(Job, job.id).created_at = utcnow() - timedelta(minutes=5)
    reconcile(db, migrated)
    text = LogReader(migrated.log_dir, job.id).tail_lines(5).text
    assert text.startswith("[lora-worker] reconcile (reconcile): The supervisor never started")


# -- a trainer the row does not name yet, and one that outlives SIGKILL ------------------------------------------

@pytest.fixture
def tokens(tmp_path) -> list[str]:
    """What the job's argv names its LoRA by: a folder of this test's own, so no test beside it (another xdist
    worker's) runs a process that looks like this job's."""
    return [f"--output_dir={tmp_path / 'output'}", "--output_name=ohwx"]


def _sleeper(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv], start_new_session=True)


def _named_argv(db, job_id: int, tokens: list[str]) -> None:
    with db.write() as s:
        s.get(type(repo.get_job(db, job_id)), job_id).argv = ["accelerate", "launch", "train.py", *tokens]


# A launcher that starts a trainer with its own argv; the trainer forks a worker that calls setsid.
LAUNCHER = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', TRAINER, *sys.argv[1:]])\n"
            "time.sleep(60)\n")
TRAINER = "import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)\n"


@pytest.mark.slow
def test_a_trainer_started_before_the_row_named_it_is_found_by_its_argv_and_start_and_killed(db, migrated, tokens):
    # The supervisor died between starting the trainer and writing its pid: the row has its own start only.
    older = _sleeper(*tokens)  # started before that supervisor: a leftover of some earlier run, not this job's
    other_lora = _sleeper(tokens[0], "--output_name=other")  # the same folder, another LoRA: another job's
    ours: list[int] = []
    try:
        time.sleep(0.05)  # a few clock ticks
        supervisor = _sleeper()
        launcher = subprocess.Popen([sys.executable, "-c", f"TRAINER = {TRAINER!r}\n" + LAUNCHER, *tokens],
                                    start_new_session=True)
        from tests.helpers import wait_for

        def tree() -> list[int]:
            return [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        ours = [launcher.pid, *wait_for(lambda: len(tree()) == 2 and tree(), what="the trainer and its worker")]
        job_id = running_job(db, boot_id=processes.boot_id(), supervisor_pid=supervisor.pid,
                             supervisor_start_ticks=processes.start_ticks(supervisor.pid))
        _named_argv(db, job_id, tokens)
        supervisor.kill()
        supervisor.wait()
        (action,) = reconcile(db, migrated)
        assert sorted(action.killed) == sorted(ours)
        assert not any(pid_alive(p) for p in ours)  # gone when the row is failed, not later
        assert pid_alive(older.pid) and pid_alive(other_lora.pid)
        row = repo.get_job(db, job_id)
        assert row.status == "failed" and f"killed its leftover processes {list(action.killed)}" in (row.error or "")
        assert launcher.wait(5) == -signal.SIGKILL
    finally:
        for pid in ours[1:]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for proc in (older, other_lora, *([launcher] if ours else [])):
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_process_that_outlives_sigkill_keeps_the_job_running_says_so_and_holds_off_a_new_job(db, migrated, tokens,
                                                                                                 monkeypatch):
    from lora_worker.errors import JobActive
    from lora_worker.run import leftovers
    from lora_worker.transcript.logreader import LogReader
    from tests.helpers.ledger import columns

    trainer = _sleeper(*tokens)
    try:
        job_id = running_job(db, boot_id=processes.boot_id(), trainer_pid=trainer.pid,
                             trainer_start_ticks=processes.start_ticks(trainer.pid))
        _named_argv(db, job_id, tokens)
        # A process in uninterruptible sleep (state D, stuck in the driver) takes SIGKILL only when it wakes:
        # here, a signal that is "sent" and changes nothing.
        monkeypatch.setattr(processes, "signal_identity", lambda ident, sig: processes.matches(ident))
        monkeypatch.setattr(processes, "signal_group", lambda pgid, sig: True)
        monkeypatch.setattr(leftovers, "GONE_WAIT_S", 0.2)
        assert reconcile(db, migrated) == [] and reconcile(db, migrated) == []
        row = repo.get_job(db, job_id)
        assert row.status == "running" and row.finished_at is None  # not ended while a process of it lives
        said = f"its processes [{trainer.pid}] outlived SIGKILL for 0.2 s"
        notes = [e for e in repo.job_events(db, job_id) if said in (e.reason or "")]
        assert [(e.from_status, e.to_status, e.actor) for e in notes] == [("running", "running", "reconcile")]  # once
        assert said in LogReader(migrated.log_dir, job_id).tail_lines(1).text
        with pytest.raises(JobActive):  # its GPU is not handed to a new job
            repo.create_job(db, columns(lora_file="/train/t2/output/ohwx.safetensors"))
        monkeypatch.undo()  # it woke: SIGKILL takes it
        (action,) = reconcile(db, migrated)
        assert action.killed == (trainer.pid,) and trainer.wait(5) == -signal.SIGKILL
        assert repo.get_job(db, job_id).status == "failed"
    finally:
        trainer.kill()
        trainer.wait()

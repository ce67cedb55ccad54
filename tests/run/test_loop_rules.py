"""The run loop's rules, against a recording fake of the host with a fake clock and a real ledger file: no
process is started, no real second passes. The end-to-end proofs with real processes are in
test_supervisor.py; these pin each rule down to the signal and the second."""
from __future__ import annotations

import signal
import sqlite3
from dataclasses import replace

import pytest

from lora_worker.config import DEFAULT_STALL_LIMITS_S, Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.statements import SAVE_AND_TEARDOWN_SQL
from lora_worker.ledger.supervisor import SupervisorLedger
from lora_worker.run import requests, runner
from lora_worker.run.runner import attend
from lora_worker.transcript.eta import DEFAULT_TAIL_S
from lora_worker.states import TERMINAL_STATES, JobState, Phase
from tests.helpers.ledger import columns
from tests.run.fake_host import LAUNCHER_PID, FakeHost, FakeJob, FakeProcess

TERM, KILL = signal.SIGTERM, signal.SIGKILL
TERMINAL = {s.value for s in TERMINAL_STATES}
T0 = 1000.0  # the fake clock's start
PHASE_LINES = {
    Phase.LOADING_MODEL: "loading model for process 0/1\n",
    Phase.CACHING_LATENTS: "caching latents...\n",
    Phase.CACHING_TEXT_ENCODER_OUTPUTS: "caching Text Encoder outputs...\n",
    Phase.PREPARING_TRAINING: "import network module: networks.lora\n",
    Phase.SAMPLING: "\ngenerating sample images at step / サンプル画像生成 ステップ: 0\n",  # before the first step
    Phase.SAVING: "saving checkpoint: /train/t1/output/ohwx_lora.safetensors\n",
}


def bar(step: int, total: int = 100, loss: float = 0.5) -> str:
    return f"\rsteps: {100 * step // total:3d}%|#   | {step}/{total} [00:01<00:09,  1.00s/it, avr_loss={loss}]"


def training(job: FakeJob, steps: int, every_s: float, start_s: float = 0.0) -> FakeJob:
    job.say(start_s, PHASE_LINES[Phase.PREPARING_TRAINING])
    for step in range(1, steps + 1):
        job.say(start_s + step * every_s, bar(step))
    return job


@pytest.fixture
def host() -> FakeHost:  # type: ignore[override]  # this module's host is the fake OS, not the disk layout
    return FakeHost(T0)


@pytest.fixture
def settings(tmp_path, tokenizers) -> Settings:
    from tests.helpers import make_host
    from tests.helpers.ledger import migrated_ledger

    values = make_host(tmp_path, tokenizers=tokenizers).settings
    migrated_ledger(values.database_path)
    return replace(values, cancel_grace_s=5.0, progress_interval_s=1.0)


@pytest.fixture
def db(settings):
    """The supervisor's own ledger path (stdlib sqlite3), as main.serve opens it."""
    database = SupervisorLedger(settings.database_path, synchronous="NORMAL")
    yield database
    database.close()


@pytest.fixture
def client_db(settings):
    """The web's connection: what a client does (cancel, reconcile) goes through it, never faulted."""
    database = Database.open(settings.database_path)
    yield database
    database.dispose()


class Ledger:
    """The supervisor's ledger, recording each state change it commits on the host's timeline, and refusing
    every write ("database is locked", as sqlite3 raises it) inside the windows of fake time in `busy`."""

    def __init__(self, db: SupervisorLedger, host: FakeHost) -> None:
        self.host = host
        self.busy: list[tuple[float, float]] = []
        self.refuse_final = 0  # how many tries to write a terminal state are refused
        self.refuse_history = 0  # how many reads of the ETA's history are refused
        before = self._before

        class Recorded(sqlite3.Connection):
            def execute(self, statement: str, params=()):  # type: ignore[no-untyped-def, override]
                before(statement, params, False)
                return super().execute(statement, params)

            def executemany(self, statement: str, rows):  # type: ignore[no-untyped-def, override]
                rows = list(rows)
                before(statement, rows, True)
                return super().executemany(statement, rows)

        db.connection_class = Recorded  # the connection is opened on first use

    def _before(self, statement: str, params, executemany: bool) -> None:  # type: ignore[no-untyped-def]
        verb = statement.lstrip().split(None, 1)[0].upper()
        if statement == SAVE_AND_TEARDOWN_SQL:
            if self.refuse_history > 0:
                self.refuse_history -= 1
                self.host.record("ledger_refused")
                raise sqlite3.OperationalError("database is locked")  # as a WAL recovery's lock would
            self.host.record("history_read")
        if verb not in ("INSERT", "UPDATE"):
            return
        final = "INSERT INTO job_events" in statement and params[3] in TERMINAL
        if final and self.refuse_final > 0:
            self.refuse_final -= 1
            self.host.record("ledger_refused")
            raise sqlite3.OperationalError("database is locked")
        if any(start <= self.host.now < end for start, end in self.busy):
            self.host.record("ledger_refused")
            raise sqlite3.OperationalError("database is locked")
        if "INSERT INTO job_events" in statement:
            self.host.record("state_written", params[3])  # (job_id, at, from_status, to_status, …)
        if statement.startswith("UPDATE jobs"):
            self.host.record("row_written")
        if "INTO job_progress" in statement:
            rows = params if executemany else [params]
            self.host.record("points_written", *(row[1] for row in rows))  # (job_id, step, loss, at)


@pytest.fixture
def ledger(db, host) -> Ledger:
    return Ledger(db, host)


def queued_job(settings: Settings, **overrides: object) -> int:
    """The API's INSERT, through a connection of its own (the supervisor's is the one under test)."""
    output_dir = str(settings.train_root / "t1" / "output")
    values = columns(output_dir=output_dir, output_name="ohwx_lora", total_steps=100, **overrides)
    api = Database.open(settings.database_path)
    try:
        return repo.create_job(api, values).id
    finally:
        api.dispose()


def supervise(host: FakeHost, settings: Settings, db: SupervisorLedger, job: FakeJob | None = None,
              **row: object) -> int:
    """Run a queued job to its end under the fake host, holding its job lock as main.serve does."""
    job_id = queued_job(settings, **row)
    host.job = job
    assert attend(job_id, settings, host, db, host.hold(f"job-{job_id}.lock")) == 0
    return job_id


def cancel_at(host: FakeHost, client_db: Database, after_s: float) -> None:
    """A client cancels the job (the first and only one of the ledger: id 1) `after_s` into the run."""
    host.at(T0 + after_s, lambda: repo.request_cancel(client_db, 1, actor="api"))


def with_limits(settings: Settings, **limits: float) -> Settings:
    return replace(settings, stall_limits_s={**DEFAULT_STALL_LIMITS_S, **limits})


def assert_ran_to_its_own_end(host: FakeHost, client_db: Database, job_id: int) -> None:
    """Nothing stopped the trainer: it failed by itself (exit 1), as its script said."""
    assert host.signals(TERM) == []
    assert repo.get_job(client_db, job_id).failure_class == "trainer_crashed"


def hanging_in_training() -> FakeJob:
    return training(FakeJob(), steps=3, every_s=0.5)


# -- cancel: SIGTERM to the group, a grace, then SIGKILL ----------------------------------------------------

def test_a_cancel_sends_sigterm_to_the_group_then_sigkill_when_the_grace_is_over(host, settings, db, client_db):
    job = hanging_in_training()
    job.launcher.ignores_term = job.trainer.ignores_term = True
    cancel_at(host, client_db, 3.0)
    job_id = supervise(host, settings, db, job)
    (term,), (kill,) = host.signals(TERM), host.signals(KILL)
    assert term.detail == (LAUNCHER_PID, TERM) and kill.detail == (LAUNCHER_PID, KILL)
    assert 3.0 <= term.at - T0 <= 3.0 + requests.CANCEL_POLL_S + runner.COALESCE_S  # seen at the next poll
    assert settings.cancel_grace_s <= kill.at - term.at <= settings.cancel_grace_s + runner.COALESCE_S
    assert host.kinds().count("signal_descendants") >= 2  # a setsid'd grandchild is signalled too
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class, done.signal) == ("cancelled", None, KILL)


def test_a_trainer_that_exits_within_the_grace_gets_no_sigkill(host, settings, db, client_db):
    job = hanging_in_training()
    job.launcher.term_delay_s = job.trainer.term_delay_s = 1.0
    cancel_at(host, client_db, 3.0)
    job_id = supervise(host, settings, db, job)
    assert len(host.signals(TERM)) == 1 and host.signals(KILL) == []
    assert [e.detail for e in host.events if e.kind == "signal_descendants"] == [(TERM,)]
    assert repo.get_job(client_db, job_id).status == "cancelled"


def test_a_grandchild_in_its_own_session_is_killed_though_the_group_is_gone(host, settings, db, client_db):
    job = hanging_in_training()
    job.grandchild = FakeProcess(LAUNCHER_PID + 2, in_group=False, ignores_term=True)
    cancel_at(host, client_db, 3.0)
    job_id = supervise(host, settings, db, job)
    assert not job.grandchild.alive and ("signal_descendants", (KILL,)) in [(e.kind, e.detail) for e in host.events]
    assert repo.get_job(client_db, job_id).status == "cancelled"


def test_a_grandchild_that_closed_the_pipe_is_killed_before_the_job_ends(host, settings, db, client_db,
                                                                         ledger):
    job = hanging_in_training().exit(3.0, 1)
    job.grandchild = FakeProcess(LAUNCHER_PID + 2, in_group=False, holds_pipe=False, ignores_term=True)
    job_id = supervise(host, settings, db, job)
    assert not job.grandchild.alive
    assert host.first("all_gone").at <= host.first("release_lock", "gpu-1.lock").at
    assert repo.get_job(client_db, job_id).failure_class == "trainer_crashed"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_supervisor_stops_the_job_as_failed_never_cancelled(host, settings, db, client_db, sig):
    """systemd's final sweep at a reboot, `systemctl kill`: nobody asked for a cancel, and a new try may pass."""
    host.at(T0 + 2.0, lambda: host.deliver(sig))
    job_id = supervise(host, settings, db, hanging_in_training())
    assert 2.0 <= host.signals(TERM)[0].at - T0 <= 2.0 + runner.COALESCE_S  # acted on by the next pass
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class) == ("failed", "supervisor_signalled")
    assert done.error.startswith(f"The supervisor received {signal.Signals(sig).name}, which was no client's cancel")
    assert host.signal_handler is None  # the previous handlers are back


def test_a_signal_then_a_cancel_ends_failed_the_first_reason_decides(host, settings, db, client_db):
    job = hanging_in_training()
    job.launcher.ignores_term = job.trainer.ignores_term = True
    host.at(T0 + 2.0, lambda: host.deliver(TERM))
    cancel_at(host, client_db, 3.0)
    job_id = supervise(host, settings, db, job)
    assert repo.get_job(client_db, job_id).failure_class == "supervisor_signalled"  # the first reason decides


def test_a_nan_loss_stops_the_run_as_a_cancel_would_and_fails_it_nan_loss(host, settings, db, client_db):
    job = FakeJob()
    job.launcher.ignores_term = job.trainer.ignores_term = True  # the grace, then SIGKILL
    job.say(0.5, PHASE_LINES[Phase.PREPARING_TRAINING])
    for step, loss in ((1, 0.5), (2, 0.4), (3, float("nan")), (4, float("nan"))):
        job.say(0.5 + step * 0.5, bar(step, loss=loss))
    job_id = supervise(host, settings, db, job)
    (term,), (kill,) = host.signals(TERM), host.signals(KILL)
    assert 2.0 <= term.at - T0 <= 2.0 + runner.COALESCE_S + settings.progress_interval_s
    assert kill.at - term.at == pytest.approx(settings.cancel_grace_s, abs=runner.COALESCE_S)
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class, done.lora_path) == ("failed", "nan_loss", None)
    assert done.error.startswith("The loss became NaN at step 3")
    assert not any(p.alive for p in job.processes)


def test_a_second_reason_to_stop_changes_neither_the_signals_nor_the_outcome(host, settings, db, client_db):
    job = hanging_in_training()
    job.launcher.ignores_term = job.trainer.ignores_term = True
    cancel_at(host, client_db, 2.0)
    host.at(T0 + 3.0, lambda: host.deliver(TERM))
    job_id = supervise(host, with_limits(settings, training=2.0), db, job)
    assert len(host.signals(TERM)) == 1 and len(host.signals(KILL)) == 1
    assert repo.get_job(client_db, job_id).status == "cancelled"


@pytest.mark.parametrize("phase", list(Phase))
def test_a_cancel_works_in_every_phase_and_leaves_nothing_alive(host, settings, db, client_db, phase):
    job = FakeJob()
    if phase is Phase.TRAINING:
        training(job, steps=2, every_s=0.5)
    elif phase is not Phase.LAUNCHING:
        job.say(0.5, PHASE_LINES[phase])
    lora = settings.train_root / "t1" / "output" / "ohwx_lora.safetensors"
    lora.parent.mkdir(parents=True)
    lora.write_bytes(b"\0" * 64)  # a save cut short by the cancel: never reported
    cancel_at(host, client_db, 3.0)
    job_id = supervise(host, settings, db, job)
    assert not any(p.alive for p in job.processes) and len(host.signals(TERM)) == 1
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.phase, done.lora_path, done.lora_sha256) == ("cancelled", phase.value, None, None)


# -- the wake-up: a cancel's signal makes the loop look at once --------------------------------------------

# Instants within one of the loop's passes (a read of up to 0.2 s, then the pause to 0.25 s): during the
# wait for output, and during the pause after it.
CANCEL_AT = [3.013, 3.113, 3.213, 3.237]


def cancel_woken(host: FakeHost, client_db, at: float, *, wake: bool) -> None:
    def flag() -> None:
        repo.request_cancel(client_db, 1, actor="api")
        if wake:
            host.wake()  # what the web sends once the flag is committed
    host.at(T0 + at, flag)


@pytest.mark.parametrize("at", CANCEL_AT)
def test_a_wake_up_makes_the_loop_look_at_the_ledger_at_once(host, settings, db, client_db, at):
    cancel_woken(host, client_db, at, wake=True)
    job_id = supervise(host, settings, db, hanging_in_training())
    (term,) = host.signals(TERM)
    assert term.at - (T0 + at) < 1e-6  # the same instant of the fake clock: no poll period waited out
    assert repo.get_job(client_db, job_id).status == "cancelled"


@pytest.mark.parametrize("at", CANCEL_AT)
def test_with_the_wake_up_lost_the_poll_still_cancels(host, settings, db, client_db, at):
    cancel_woken(host, client_db, at, wake=False)
    job_id = supervise(host, settings, db, hanging_in_training())
    (term,) = host.signals(TERM)
    assert 0 < term.at - (T0 + at) <= requests.CANCEL_POLL_S + runner.COALESCE_S
    assert repo.get_job(client_db, job_id).status == "cancelled"


def test_a_wake_up_with_no_cancel_flagged_changes_nothing(host, settings, db, client_db):
    job = hanging_in_training().exit(5.0, 1)
    for at in (1.0, 2.05, 3.3):
        host.at(T0 + at, host.wake)
    job_id = supervise(host, settings, db, job)
    assert host.signals(TERM) == []
    assert repo.get_job(client_db, job_id).failure_class == "trainer_crashed"


# -- the ledger while it runs ------------------------------------------------------------------------------

def test_the_ledger_is_written_about_once_an_interval_not_once_a_step(host, settings, db, client_db, ledger):
    interval = 2.0
    job = training(FakeJob(), steps=400, every_s=0.02).exit(9.0, 1)  # 400 steps, 800 redraws a second… in 8 s
    job_id = supervise(host, replace(settings, progress_interval_s=interval), db, job)
    writes = [e for e in host.events if e.kind == "row_written"]
    span = writes[-1].at - writes[0].at
    # the start, the trainer's pid, two phase changes (preparing, training), one an interval, the last
    # flush, the end
    assert span / interval - 1 <= len(writes) <= 2 + 2 + (span / interval + 1) + 2
    assert repo.get_job(client_db, job_id).step == 400


def test_the_eta_is_history_before_training_then_measured(host, settings, db, client_db):
    job = training(FakeJob().say(0.1, PHASE_LINES[Phase.LOADING_MODEL]), steps=100, every_s=0.5, start_s=10.0)
    job.exit(70.0, 1)
    rows = []
    for at in (2.0, 5.0, 30.0):
        host.at(T0 + at, lambda: rows.append(repo.get_job(client_db, 1)))
    supervise(host, settings, db, job, estimated_duration_s=120.0)
    loading, later, trained = rows
    assert (loading.phase, loading.eta_basis, later.eta_basis) == ("loading_model", "history", "history")
    # the estimate less the time since the run began, as of the last write (at most an interval ago)
    assert 120.0 - 2.0 <= loading.eta_s <= 120.0 - 2.0 + settings.progress_interval_s
    assert later.eta_s < loading.eta_s
    assert (trained.phase, trained.eta_basis) == ("training", "measured")
    assert trained.rate == pytest.approx(2.0, rel=0.05)  # 0.5 s a step
    # the steps left at the measured rate, and the save and teardown after them (no history yet: the default)
    assert trained.eta_s == pytest.approx((100 - trained.step) / trained.rate + DEFAULT_TAIL_S, rel=0.05)


# -- the stall watchdog ------------------------------------------------------------------------------------

@pytest.mark.parametrize("phase", list(Phase))
def test_a_phase_silent_past_its_limit_is_stopped_and_stalled(host, settings, db, client_db, phase):
    limit = 30.0
    job = FakeJob()
    if phase is Phase.TRAINING:
        training(job, steps=2, every_s=1.0)
    elif phase is not Phase.LAUNCHING:
        job.say(1.0, PHASE_LINES[phase])
    went_quiet = {Phase.LAUNCHING: 0.0, Phase.TRAINING: 2.0}.get(phase, 1.0)
    limits = {p.value: 1e6 for p in Phase} | {phase.value: limit}  # only this phase's limit can fire
    job_id = supervise(host, replace(settings, stall_limits_s=limits), db, job)
    (term,) = host.signals(TERM)
    # output is parsed within a pass or two of arriving (a redraw a moment later), and checked every pass
    assert went_quiet + limit < term.at - T0 <= went_quiet + limit + 4 * runner.COALESCE_S
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class, done.phase) == ("failed", "stalled", phase.value)
    assert f"phase {phase.value}" in done.error


def test_the_silence_counts_from_the_trainers_start_not_the_supervisors(host, settings, db, client_db):
    # Waiting 4 s for the GPU lock is not the trainer's silence: a 3 s launching limit starts at the spawn.
    host.lock_wait_s = 4.0
    job = training(FakeJob().say(2.5, PHASE_LINES[Phase.LOADING_MODEL]), steps=3, every_s=0.5, start_s=2.6)
    job.exit(5.0, 1)
    job_id = supervise(host, with_limits(settings, launching=3.0), db, job)
    assert_ran_to_its_own_end(host, client_db, job_id)


def test_a_redrawn_bar_without_a_new_step_is_a_stall_though_output_flows(host, settings, db, client_db):
    job = training(FakeJob(), steps=5, every_s=0.5)
    for i in range(1, 200):
        job.say(2.5 + i * 0.1, bar(5))  # the same step, redrawn ten times a second
    job.exit(30.0, 0)
    job_id = supervise(host, with_limits(settings, training=8.0), db, job)
    (term,) = host.signals(TERM)
    assert 2.5 + 8.0 < term.at - T0 <= 2.5 + 8.0 + 4 * runner.COALESCE_S
    assert (repo.get_job(client_db, job_id).failure_class, repo.get_job(client_db, job_id).step) == ("stalled", 5)


def test_in_a_quiet_phase_any_output_is_life(host, settings, db, client_db):
    job = FakeJob().say(0.5, PHASE_LINES[Phase.CACHING_LATENTS])
    for i in range(1, 40):
        job.say(0.5 + i, f"caching latents {i}/40\n")  # a line a second for 40 s; the limit is 5 s
    job.exit(41.0, 1)
    job_id = supervise(host, with_limits(settings, caching_latents=5.0), db, job)
    assert_ran_to_its_own_end(host, client_db, job_id)


def test_each_phase_has_its_own_limit(host, settings, db, client_db):
    # Loading is silent for 20 s, past the training limit (5 s) but within its own (60 s).
    job = training(FakeJob().say(0.1, PHASE_LINES[Phase.LOADING_MODEL]), steps=10, every_s=1.0, start_s=20.0)
    job.exit(31.0, 1)
    job_id = supervise(host, with_limits(settings, loading_model=60.0, training=5.0), db, job)
    assert_ran_to_its_own_end(host, client_db, job_id)


# -- the orphaned launcher ---------------------------------------------------------------------------------

def test_a_killed_launcher_whose_trainer_holds_the_pipe_is_stopped_at_once(host, settings, db, client_db):
    job = hanging_in_training().kill_launcher(3.0, KILL)
    job_id = supervise(host, settings, db, job)
    (term,) = host.signals(TERM)
    assert 3.0 <= term.at - T0 <= 3.0 + runner.COALESCE_S  # not after the 10 s drain grace
    assert not job.trainer.alive
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class, done.signal) == ("failed", "killed_by_signal", KILL)
    log = (settings.log_dir / f"job-{job_id}.log").read_text()
    assert "the launcher was killed by SIGKILL; SIGTERM to process group" in log


def test_stragglers_holding_the_pipe_after_a_clean_exit_are_killed_after_the_drain_grace(host, settings, db,
                                                                                        client_db):
    job = hanging_in_training()
    job.grandchild = FakeProcess(LAUNCHER_PID + 2, in_group=False, ignores_term=True)
    job.exit(3.0, 1)  # the launcher reports its trainer's failure; a grandchild lives on with the pipe
    job_id = supervise(host, settings, db, job)
    assert host.signals(TERM) == []  # not a stop: the trainer's own outcome stands
    (kill,) = host.signals(KILL)
    assert runner.DRAIN_GRACE_S < kill.at - T0 - 3.0 <= runner.DRAIN_GRACE_S + 2 * runner.COALESCE_S
    assert repo.get_job(client_db, job_id).failure_class == "trainer_crashed"


def test_two_phase_markers_in_one_read_are_both_recorded(host, settings, db, client_db):
    job = FakeJob()
    job.say(0.5, PHASE_LINES[Phase.LOADING_MODEL] + PHASE_LINES[Phase.CACHING_LATENTS])  # one read
    training(job, steps=2, every_s=0.5, start_s=1.0).exit(3.0, 1)
    job_id = supervise(host, settings, db, job)
    passed = [e.reason for e in repo.job_events(client_db, job_id) if e.from_status == e.to_status == "running"]
    assert passed == ["phase loading_model", "phase caching_latents", "phase preparing_training", "phase training"]


# -- the run log comes before `running` ---------------------------------------------------------------------

@pytest.mark.parametrize("cause", ["no_space", "not_a_directory"])
def test_a_run_log_that_cannot_be_created_fails_the_job_from_queued(host, settings, db, client_db, monkeypatch,
                                                                     cause):
    """No space or no inodes left for the log (or its directory taken by a file): the job ends `failed` with the
    reason, never a `running` row that nothing supervises, and no trainer starts."""
    if cause == "no_space":
        import errno
        import os

        real_open = os.open

        def full(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
            # the log is opened by name inside logs/ (host/fs.py open_in: dir_fd), or by its whole path
            if str(path).startswith(str(settings.log_dir)) or kwargs.get("dir_fd") is not None \
                    and str(path).startswith("job-") and flags & os.O_CREAT:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real_open(path, flags, *args, **kwargs)
        monkeypatch.setattr(os, "open", full)
        why = "No space left on device"
    else:
        settings.log_dir.parent.mkdir(parents=True, exist_ok=True)
        settings.log_dir.write_text("")  # a file where the logs directory should be
        why = "File exists"
    job_id = supervise(host, settings, db, hanging_in_training())
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class) == ("failed", "launch_error")
    assert done.error.startswith(f"Cannot create the run log of job {job_id} in {settings.log_dir} ({why})")
    assert [(e.from_status, e.to_status) for e in repo.job_events(client_db, job_id)] == [
        (None, "queued"), ("queued", "failed")]  # never `running`
    assert "spawn" not in host.kinds() and done.started_at is None


# -- a busy ledger ------------------------------------------------------------------------------------------

def test_progress_refused_by_a_busy_ledger_is_kept_and_lands_later(host, settings, db, client_db, ledger):
    job = training(FakeJob(), steps=20, every_s=0.5).exit(12.0, 1)
    ledger.busy = [(T0 + 2.0, T0 + 8.0)]
    job_id = supervise(host, settings, db, job)
    assert "ledger_refused" in host.kinds()
    assert [p.step for p in repo.progress_points(client_db, job_id)] == list(range(1, 21))  # none lost
    landed = [e for e in host.events if e.kind == "points_written"]
    assert any(e.at >= T0 + 8.0 and 5 in e.detail for e in landed)  # step 5 came in the busy window
    assert repo.get_job(client_db, job_id).step == 20


def test_the_final_state_is_retried_until_it_lands_while_the_job_lock_stays_held(host, settings, db,
                                                                                 client_db, ledger):
    ledger.refuse_final = 10  # ten tries meet a locked ledger: about 26 s of backing off
    job_id = supervise(host, settings, db, training(FakeJob(), steps=2, every_s=0.5).exit(2.0, 1))
    refused = [e for e in host.events if e.kind == "ledger_refused"]
    written = host.first("state_written", "failed")
    assert len(refused) == 10 and written.at - refused[0].at > 20.0
    assert host.first("release_lock", "gpu-1.lock").at <= refused[0].at  # every process was gone already
    assert host.first("release_lock", f"job-{job_id}.lock").at >= written.at  # held all the while
    assert repo.get_job(client_db, job_id).failure_class == "trainer_crashed"


def test_the_gpu_lock_is_released_once_the_processes_are_gone_not_after_a_locked_ledger(host, settings, db,
                                                                                          client_db, ledger):
    """A full or locked ledger at the end holds the job (its last points and state wait), never the GPU: another
    trainer of the interlock may take the card as soon as every process of the job is gone."""
    ledger.busy = [(T0 + 1.6, T0 + 40.0)]  # the last progress write and the final state wait 38 s
    job_id = supervise(host, settings, db, training(FakeJob(), steps=2, every_s=0.5).exit(2.0, 1))
    gone, freed = host.first("all_gone"), host.first("release_lock", "gpu-1.lock")
    assert gone.at <= freed.at <= T0 + 2.0 + runner.COALESCE_S + 0.1  # at once, not at T0 + 40
    assert host.first("state_written", "failed").at >= T0 + 40.0
    assert repo.get_job(client_db, job_id).failure_class == "trainer_crashed"


def test_a_busy_ledger_at_the_start_is_waited_out(host, settings, db, client_db, ledger):
    ledger.busy = [(T0, T0 + 20.0)]
    job_id = supervise(host, settings, db, training(FakeJob(), steps=2, every_s=0.5).exit(2.0, 1))
    assert host.first("spawn").at >= T0 + 20.0
    assert repo.get_job(client_db, job_id).status == "failed"


# -- the final writes, in order ----------------------------------------------------------------------------

def test_the_final_writes_come_in_order_processes_gpu_lock_state_job_lock(host, settings, db, client_db, ledger):
    job = hanging_in_training()
    job.trainer.ignores_term = True
    job.trainer.unkillable_until = T0 + 20.0  # stuck in the driver: outlives SIGKILL for a while
    cancel_at(host, client_db, 3.0)
    job_id = supervise(host, settings, db, job)
    order = [(e.kind, e.detail) for e in host.events
             if e.kind in ("all_gone", "release_lock", "state_written") and e.detail != ("running",)]
    assert order == [("all_gone", ()), ("release_lock", ("gpu-1.lock",)), ("state_written", ("cancelled",)),
                     ("release_lock", (f"job-{job_id}.lock",))]
    assert host.first("all_gone").at >= T0 + 20.0  # the GPU lock waited for the stuck process


def test_a_job_ended_elsewhere_is_stopped_and_its_state_left_alone(host, settings, db, client_db):
    def reconciled() -> None:
        repo.transition(client_db, 1, JobState.FAILED, actor="reconcile", failure_class="supervisor_lost")
    host.at(T0 + 3.0, reconciled)
    job_id = supervise(host, settings, db, hanging_in_training())
    assert len(host.signals(TERM)) == 1
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class) == ("failed", "supervisor_lost")


def test_a_trainer_that_cannot_start_is_a_launch_error_and_nothing_is_signalled(host, settings, db, client_db):
    host.spawn_error = FileNotFoundError(2, "No such file or directory", "accelerate")
    job_id = supervise(host, settings, db, None)
    assert host.signals(TERM) == host.signals(KILL) == []
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class) == ("failed", "launch_error")
    assert "Cannot start the trainer" in done.error


def test_anything_moved_since_dispatch_is_a_launch_error_and_the_trainer_never_starts(host, settings, db,
                                                                                       client_db):
    host.moved = "output_dir is now a symlink"  # what run/prelaunch.py found (tested there on real files)
    job_id = supervise(host, settings, db, None)
    assert "what_moved" in host.kinds() and "spawn" not in host.kinds()
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class) == ("failed", "launch_error")
    assert done.error.startswith("Refusing to start the trainer: output_dir is now a symlink.")


def test_a_gpu_held_by_another_trainer_fails_the_job_without_starting_one(host, settings, db, client_db):
    host.locks_refused = {"gpu-1.lock"}
    job_id = supervise(host, settings, db, hanging_in_training())
    assert "spawn" not in host.kinds()
    assert repo.get_job(client_db, job_id).failure_class == "launch_error"


def test_a_bug_in_the_loop_stops_every_process_and_fails_the_job_as_supervisor_lost(host, settings, db, client_db):
    def broken(keep: set[int]) -> None:
        if keep and host.now > T0 + 2.0:  # the loop's call (keeping the launcher), not the clean-up's
            raise RuntimeError("a bug")
    host.reap_orphans = broken  # type: ignore[method-assign]
    job = hanging_in_training()
    job.trainer.ignores_term = True
    job_id = supervise(host, settings, db, job)
    assert not any(p.alive for p in job.processes) and host.signals(KILL)
    done = repo.get_job(client_db, job_id)
    assert (done.status, done.failure_class) == ("failed", "supervisor_lost")
    assert "internal error (RuntimeError: a bug)" in done.error


# -- exec early ---------------------------------------------------------------------------------------------------

def test_the_trainer_starts_right_after_running_is_written_and_the_history_is_read_after_it(host, settings, db,
                                                                                              ledger, client_db):
    job_id = supervise(host, settings, db, training(FakeJob(), steps=3, every_s=0.5).exit(2.0, 1))
    kinds = [k for k in host.kinds() if k in ("state_written", "spawn", "history_read")]
    assert kinds[:3] == ["state_written", "spawn", "history_read"]  # running, the exec, then the ETA's history
    assert host.first("state_written", "running").at == host.first("spawn").at  # nothing waited in between
    assert repo.get_job(client_db, job_id).failure_class == "trainer_crashed"


def test_a_history_read_the_ledger_refuses_never_holds_up_the_trainer_and_is_asked_again(host, settings, db,
                                                                                           ledger, client_db):
    ledger.refuse_history = 3
    job = training(FakeJob(), steps=4, every_s=0.5).exit(2.5, 1)
    job_id = supervise(host, settings, db, job)
    assert host.first("spawn").at == T0  # started at once
    refused = [e.at for e in host.events if e.kind == "ledger_refused"]
    assert len(refused) == 3 and refused[0] == T0 and refused[-1] < host.first("history_read").at
    assert host.first("history_read").at <= T0 + 3 * runner.COALESCE_S  # asked again on the next ticks
    assert [p.step for p in repo.progress_points(client_db, job_id)] == [1, 2, 3, 4]  # and the run went on


def test_once_the_launcher_has_exited_the_end_is_written_without_another_pause(host, settings, db, ledger,
                                                                               client_db):
    exit_s = 2.1
    supervise(host, settings, db, training(FakeJob(), steps=4, every_s=0.5).exit(exit_s, 1))
    final = next(e for e in host.events if e.kind == "state_written" and e.detail[0] in TERMINAL)
    # The exit is noticed when the pause it fell into ends (≤ COALESCE_S); from there the pipe's end, the
    # last progress write and the final state follow at once, with no second pause.
    assert final.at - (T0 + exit_s) <= runner.COALESCE_S

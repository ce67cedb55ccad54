"""The follower's own rules (transcript/follower.py), against a recording ledger and a fake clock: what each
backend's adapter relies on it for, pinned to the pass. The same rules are proven with real processes on both
backends by tests/contract/test_job_life.py."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lora_worker.errors import LedgerBusy
from lora_worker.states import FailureClass, JobState
from lora_worker.transcript.ending import Reasons
from lora_worker.transcript.follower import Exit, Facts, Follower, Order, Stop, Timing
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.outcome import Outcome
from lora_worker.transcript.stop import StopReason

GRACE = 5.0
REASONS = Reasons(succeeded="ok", cancelled="cancelled")
TRAINING = b"import network module: networks.lora\n"


def bar(step: int, loss: str = "0.5") -> bytes:
    return f"\rsteps:  10%|#   | {step}/100 [00:01<00:09,  1.00s/it, avr_loss={loss}]".encode()


@dataclass
class Job:
    output_dir: str
    id: int = 7
    output_name: str = "ohwx"
    lora_rank: int = 4
    lora_steps: int = 100
    seed: int = 42
    lora_dtype: str = "F16"
    output_dev_ino: str | None = None
    total_steps: int = 100
    estimated_duration_s: float | None = None
    resume_step: int = 0
    backend: str = "local"
    tier: str = "fast"
    device_index: int = 0
    sd_scripts_commit: str | None = None
    argv: list[str] = field(default_factory=list)
    sample_prompts: list[dict[str, Any]] | None = None

    @property
    def lora_file(self) -> str:
        return str(Path(self.output_dir) / f"{self.output_name}.safetensors")


@dataclass
class Ledger:
    """Takes every write, and records it; `refuse` names the calls that raise LedgerBusy (once each)."""

    calls: list[tuple[str, Any]] = field(default_factory=list)
    refuse: list[str] = field(default_factory=list)
    running: bool = True

    def _call(self, name: str, detail: Any = None) -> bool:
        if name in self.refuse:
            self.refuse.remove(name)
            raise LedgerBusy()
        self.calls.append((name, detail))
        return self.running

    def update_running(self, job_id: int, **values: Any) -> bool:
        return self._call("update_running")

    def mark_succeeded(self, job_id: int, *, reason: str, **values: Any) -> bool:
        return self._call("final", "succeeded")

    def mark_cancelled(self, job_id: int, *, reason: str, **values: Any) -> bool:
        return self._call("final", "cancelled")

    def fail_job(self, job_id: int, *, failure_class: FailureClass, sentence: str, **values: Any) -> bool:
        return self._call("final", failure_class.value)

    def note(self, job_id: int, reason: str) -> None:
        self._call("note", reason)

    def save_and_teardown_durations(self, *, backend: str, tier: str, device_index: int | None) -> list[float]:
        self._call("history")
        return []

    def kinds(self) -> list[str]:
        return [name for name, _ in self.calls]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def job(tmp_path: Path) -> Job:
    (tmp_path / "out").mkdir()
    return Job(str(tmp_path / "out"))


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def follower(job: Job, ledger: Ledger, clock: Clock, tmp_path: Path) -> Iterator[Follower]:
    joblog = JobLog(tmp_path / "logs", job.id, head_bytes=1 << 20, tail_bytes=1 << 20)
    made = Follower(job, joblog, ledger, clock, Timing({"training": 30.0}, GRACE, 1.0), REASONS)
    made.start(clock.now)
    yield made
    joblog.close()


def test_the_first_reason_decides_and_a_later_one_changes_neither_the_stop_nor_the_end(follower, clock):
    follower.output.consume(TRAINING + bar(1), clock.now)
    assert follower.tick(clock.now, Facts(cancel=True)) == Order(Stop.TERM, "cancel requested")
    follower.output.consume(bar(2, "nan"), clock.now)
    clock.now += 1
    assert follower.tick(clock.now, Facts(cancel=True, signalled="SIGTERM")) is None  # no second TERM
    clock.now += GRACE
    assert follower.tick(clock.now, Facts()).stop is Stop.KILL
    assert follower.tick(clock.now + 1, Facts()) is None  # KILL once
    assert follower.decide(Exit(returncode=-9)).state is JobState.CANCELLED


def test_a_nan_loss_is_a_stop_and_its_end_names_the_step(follower, clock):
    follower.output.consume(TRAINING + bar(1) + bar(2, "nan"), clock.now)
    assert follower.tick(clock.now, Facts()) == Order(Stop.TERM, "the loss became NaN at step 2")
    outcome = follower.decide(Exit(returncode=-15))
    assert (outcome.failure_class, outcome.sentence.startswith("The loss became NaN at step 2")) == (
        FailureClass.NAN_LOSS, True)


def test_a_nan_the_trainer_outran_is_no_success(follower, clock):
    """The trainer ended (exit 0, `model saved.`) before any pass saw the NaN: its LoRA holds NaN weights."""
    follower.output.consume(TRAINING + bar(1, "nan") + b"\nmodel saved.\n", clock.now)
    assert follower.tick(clock.now, Facts(ended=True)) is None  # nothing left to stop
    assert follower.decide(Exit(returncode=0)).failure_class is FailureClass.NAN_LOSS


def test_a_trainer_that_had_ended_keeps_its_outcome_over_a_late_cancel(follower, clock):
    follower.output.consume(TRAINING + bar(1), clock.now)
    assert follower.tick(clock.now, Facts(cancel=True, ended=True)) is None
    assert follower.reason is None
    assert follower.decide(Exit(returncode=1)).failure_class is FailureClass.TRAINER_CRASHED


def test_a_stall_is_checked_only_while_the_trainer_runs(follower, clock):
    follower.output.consume(TRAINING + bar(1), clock.now)
    clock.now += 31
    assert follower.tick(clock.now, Facts(running=False)) is None  # held in a queue: no silence to count
    order = follower.tick(clock.now, Facts())
    assert order is not None and order.stop is Stop.TERM and order.why.startswith("no progress in training")
    assert follower.decide(Exit(returncode=-15)).failure_class is FailureClass.STALLED


def test_a_queued_job_gets_one_plain_cancel_then_term_if_it_started_all_the_same(follower, clock):
    assert follower.tick(clock.now, Facts(cancel=True, running=False)) == Order(Stop.CANCEL, "cancel requested")
    assert follower.tick(clock.now + 1, Facts(cancel=True, running=False)) is None
    assert follower.tick(clock.now + 2, Facts(cancel=True)).stop is Stop.TERM  # the cancel raced its start
    assert follower.reason is StopReason.CANCEL


def test_the_schedulers_own_ending_loses_to_the_followers_reason_and_wins_over_the_exit(follower, clock):
    timeout = Outcome(JobState.FAILED, FailureClass.TIME_LIMIT, "Slurm ended it.")
    assert follower.decide(Exit(returncode=0, scheduler=timeout)) is timeout
    follower.outcome = None
    follower.output.consume(TRAINING + bar(1, "nan"), clock.now)
    follower.tick(clock.now, Facts())
    assert follower.decide(Exit(returncode=-15, scheduler=timeout)).failure_class is FailureClass.NAN_LOSS


def test_the_end_is_written_in_order_each_step_once_and_a_refusal_is_retried(follower, ledger, job, clock):
    """Set aside, noted, the last progress, the final row: a step the ledger refuses is retried on the next call,
    the ones before it are not done again."""
    lora = Path(job.lora_file)
    lora.write_bytes(b"half")
    follower.output.consume(TRAINING + bar(1), clock.now)
    follower.tick(clock.now, Facts(cancel=True))
    follower.output.consume(bar(2), clock.now)  # a step the last progress write carries
    follower.decide(Exit(returncode=-15))
    ledger.calls.clear()
    ledger.refuse = ["note", "final"]
    assert follower.finish() is None  # the note refused
    assert follower.finish() is None  # the final write refused
    assert follower.finish() is True
    assert ledger.kinds() == ["note", "update_running", "final"]
    assert not lora.exists() and (lora.parent / f"{lora.name}.partial-{job.id}").read_bytes() == b"half"


def test_a_success_keeps_its_lora_in_place_whatever_the_row_says_of_a_cancel(follower, ledger, job):
    """A trainer that finished before the cancel reached it keeps its verified LoRA (states.CANCEL_RULE)."""
    lora = Path(job.lora_file)
    lora.write_bytes(b"whole")
    follower.outcome = Outcome(JobState.SUCCEEDED, lora_path=str(lora))
    follower._ran = True
    assert follower.finish() is True
    assert lora.read_bytes() == b"whole" and "note" not in ledger.kinds()


def test_nothing_is_set_aside_when_no_trainer_of_the_job_ran(follower, ledger, job):
    """Whatever lies at the path then is not the job's: the pre-exec look refused it, or nothing started."""
    lora = Path(job.lora_file)
    lora.write_bytes(b"someone else's")
    refused = Outcome(JobState.FAILED, FailureClass.LAUNCH_ERROR, "Refusing to start the trainer: it moved.")
    follower.decide(Exit(trainer_ran=False, settled=refused))
    assert follower.finish() is True
    assert lora.read_bytes() == b"someone else's"


def test_a_row_ended_elsewhere_is_a_stop_and_its_end_is_not_written_over(follower, ledger, clock):
    ledger.running = False  # the next progress write finds the row no longer running
    follower.output.consume(TRAINING + bar(1), clock.now)
    clock.now += 2
    order = follower.tick(clock.now, Facts())
    assert follower.lost and order is not None and order.stop is Stop.TERM
    follower.decide(Exit(returncode=-15))
    assert follower.finish() is False

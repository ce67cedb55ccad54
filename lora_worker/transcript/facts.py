"""What a backend and its job's follower (transcript/follower.py) tell each other: the facts of a pass and of
the end that the backend learns its own way, the stop the follower orders, and what it reads of the row and
writes through the ledger."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from lora_worker.transcript.checkpoints import CheckpointJob
from lora_worker.transcript.ending import FinalLedger
from lora_worker.transcript.outcome import Outcome
from lora_worker.transcript.progress import ProgressLedger
from lora_worker.transcript.samples import SampleJob


class Stop(Enum):
    TERM = "term"
    KILL = "kill"
    CANCEL = "cancel"  # the scheduler's plain cancel: the job is in its queue, nothing of it runs to signal


@dataclass(frozen=True)
class Order:
    """What `tick` asks the backend to send now, and why (for the run log)."""

    stop: Stop
    why: str


@dataclass(frozen=True)
class Facts:
    """What the backend saw on this pass, besides the trainer's bytes."""

    cancel: bool = False  # a client's cancel is flagged on the row
    lost: bool = False  # the row is no longer `running`: someone else ended the job
    signalled: str | None = None  # the name of a signal the follower's own process got (no client's cancel)
    requeued: str | None = None  # the scheduler put the job back in its queue after it ran: why, in words
    orphaned: str | None = None  # the launcher died and left its trainer running: how, in words
    running: bool = True  # the trainer runs (False: the scheduler holds the job in its queue)
    ended: bool = False  # nothing of the trainer is left to stop: it ended on its own


@dataclass(frozen=True)
class Exit:
    """How the job ended, as its backend learned it."""

    returncode: int | None = None  # the trainer's own, as a Popen return code (negative: a signal)
    trainer_ran: bool = True  # a trainer of this job ran: what lies at the LoRA's path is its
    settled: Outcome | None = None  # decided by the backend alone: the launch was refused, or its follower failed
    scheduler: Outcome | None = None  # an ending the scheduler caused (its limits, its nodes, a requeue…)
    cancel_seen: bool = False  # the scheduler says it cancelled the job after a client's cancel was flagged


class FollowedJob(CheckpointJob, SampleJob, Protocol):
    """The row's columns the follower reads: a supervisor's JobRecord, or the poller's ORM Job."""

    @property
    def id(self) -> int: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def estimated_duration_s(self) -> float | None: ...
    @property
    def resume_step(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def device_index(self) -> int: ...
    @property
    def lora_file(self) -> str: ...
    @property
    def sd_scripts_commit(self) -> str | None: ...
    @property
    def argv(self) -> list[str]: ...


class FollowerLedger(ProgressLedger, FinalLedger, Protocol):
    def note(self, job_id: int, reason: str) -> None:
        """An event of the running job that changes no state (a file moved aside)."""

    def save_and_teardown_durations(self, *, backend: str, tier: str, device_index: int | None) -> list[float]:
        """How long finished jobs of this backend and tier took after their last step (save and teardown); of
        this card too where `device_index` is given."""


@dataclass(frozen=True)
class Timing:
    stall_limits_s: Mapping[str, float]
    grace_s: float  # between TERM and KILL
    progress_interval_s: float  # the running row's writes, at most this often (0: on every pass)

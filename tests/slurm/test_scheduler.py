"""Slurm's commands as the scheduler wrapper calls them, and what it makes of their output (formats recorded
from Slurm 22.05, the version of the reference's single-node install)."""
from __future__ import annotations

from pathlib import Path

import pytest

from lora_worker.slurm.scheduler import (Result, Scheduler, SchedulerUnavailable, SlurmJob, parse_sacct,
                                             parse_scontrol, parse_squeue)


class Recorded:
    def __init__(self, *answers: Result) -> None:
        self.answers = list(answers)
        self.argvs: list[list[str]] = []

    def __call__(self, argv: list[str]) -> Result:
        self.argvs.append(argv)
        return self.answers.pop(0)


def test_sbatch_parsable_gives_the_job_id_with_or_without_a_cluster_name(tmp_path):
    for out in ("4242\n", "4242;lw\n"):
        run = Recorded(Result(0, out, ""))
        assert Scheduler(tmp_path / "bin", run).submit(["--parsable"], tmp_path / "1.sbatch") == "4242"
        assert run.argvs[0] == [str(tmp_path / "bin" / "sbatch"), "--parsable", str(tmp_path / "1.sbatch")]


def test_a_refused_submission_says_what_sbatch_said(tmp_path):
    run = Recorded(Result(1, "", "sbatch: error: invalid partition specified: gpux\n"))
    with pytest.raises(SchedulerUnavailable, match="invalid partition specified: gpux"):
        Scheduler(None, run).submit([], tmp_path / "1.sbatch")


def test_squeue_lines_give_state_and_pending_reason():
    out = "101|PENDING|Resources\n102|PENDING|Priority\n103|RUNNING|None\n104|COMPLETED|None\n"
    assert parse_squeue(out) == [
        SlurmJob("101", "PENDING", "Resources", detail="PENDING"),
        SlurmJob("102", "PENDING", "Priority", detail="PENDING"),
        SlurmJob("103", "RUNNING", None, detail="RUNNING"), SlurmJob("104", "COMPLETED", None, detail="COMPLETED")]


def test_squeue_is_asked_once_for_all_jobs_and_an_unknown_id_is_not_an_error():
    run = Recorded(Result(0, "7|RUNNING|None\n", ""),
                   Result(1, "", "slurm_load_jobs error: Invalid job id specified\n"))
    scheduler = Scheduler(None, run)
    assert list(scheduler.queue(["7", "8"])) == ["7"]
    assert run.argvs[0] == ["squeue", "--noheader", "--states=all", "--jobs=7,8", "--format=%i|%T|%r"]
    assert scheduler.queue(["9"]) == {}


def test_squeue_that_cannot_reach_slurmctld_is_unavailable_not_empty():
    run = Recorded(Result(1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"))
    with pytest.raises(SchedulerUnavailable):
        Scheduler(None, run).queue(["7"])


@pytest.mark.parametrize(("line", "state", "code", "signal"), [
    ("5|COMPLETED|0:0|None", "COMPLETED", 0, 0),
    ("5|FAILED|3:0|NonZeroExitCode", "FAILED", 3, 0),
    ("5|FAILED|72:0|NonZeroExitCode", "FAILED", 72, 0),  # exit 200, truncated by sacct
    ("5|FAILED|0:9|None", "FAILED", 0, 9),
    ("5|CANCELLED by 0|0:15|None", "CANCELLED", 0, 15),
    ("5|OUT_OF_MEMORY|0:125|OutOfMemory", "OUT_OF_MEMORY", 0, 125),
    ("5|TIMEOUT|0:0|TimeLimit", "TIMEOUT", 0, 0),
    ("5|NODE_FAIL|0:0|NodeDown", "NODE_FAIL", 0, 0),
])
def test_sacct_lines_give_the_state_word_and_the_exit_code(line, state, code, signal):
    (job,) = parse_sacct(line + "\n")
    assert (job.job_id, job.state, job.exit_code, job.exit_signal, job.detail) == ("5", state, code, signal,
                                                                                  line.split("|")[1])


def test_sacct_is_asked_for_allocations_only():
    run = Recorded(Result(0, "5|COMPLETED|0:0|None\n", ""))
    assert Scheduler(None, run).accounting(["5"])["5"].state == "COMPLETED"
    assert run.argvs[0] == ["sacct", "--noheader", "--parsable2", "--allocations", "--jobs=5",
                            "--format=JobID,State,ExitCode,Reason"]


def test_scontrol_keeps_an_exit_code_above_127():
    out = ("JobId=5 JobName=lora-1 UserId=root(0) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
           "Requeue=0 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=200:0 RunTime=00:00:01\n")
    assert parse_scontrol(out) == SlurmJob("5", "FAILED", "NonZeroExitCode", 200, 0, detail="FAILED")
    run = Recorded(Result(1, "", "slurm_load_jobs error: Invalid job id specified\n"))
    assert Scheduler(None, run).show("5") is None


def test_scancel_sends_a_signal_to_every_process_of_the_job_or_cancels_plainly():
    run = Recorded(Result(0, "", ""), Result(0, "", ""))
    scheduler = Scheduler(Path("/usr/bin"), run)
    scheduler.cancel("5", "TERM")
    scheduler.cancel("5")
    assert run.argvs == [["/usr/bin/scancel", "--signal=TERM", "--full", "5"], ["/usr/bin/scancel", "5"]]


@pytest.mark.slow
def test_a_missing_command_is_unavailable(tmp_path):
    with pytest.raises(SchedulerUnavailable):
        Scheduler(tmp_path).queue(["5"])  # tmp_path/squeue does not exist

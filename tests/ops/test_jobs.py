"""`lora-worker jobs`: ls, show, log [-f], cancel [--all], prune, on the ledger directly."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lora_worker.ops.cli import build_parser
from lora_worker.errors import JobFinished
from lora_worker.ledger import repository as repo
from lora_worker.states import JobState
from lora_worker.transcript.logfile import log_paths
from lora_worker.host.locks import hold_lock, job_lock_path
from tests.helpers import set_modes, wait_for
from tests.helpers.service import settings_env
from tests.helpers.ledger import columns
from tests.helpers.cli import finished, jobs, write_log


def cli(settings, *argv: str) -> subprocess.CompletedProcess[str]:
    """The installed entry point, as an operator runs it."""
    lora_worker = str(Path(sys.executable).parent / "lora-worker")
    return subprocess.run([lora_worker, *argv], env={**os.environ, **settings_env(settings)}, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def supervised(db, migrated) -> Iterator[Callable[[], int]]:
    """Makes the running job (one at a time) whose supervisor is alive: the test holds its lock."""
    locks: list[int] = []

    def start() -> int:
        job = repo.create_job(db, columns())
        fd = hold_lock(job_lock_path(migrated, job.id))
        assert fd is not None
        locks.append(fd)
        repo.transition(db, job.id, JobState.RUNNING, actor="supervisor", phase="training")
        return job.id

    yield start
    for fd in locks:
        os.close(fd)


def test_ls_prints_a_table_of_recent_jobs_newest_first(db, migrated, supervised):
    ok = finished(db, JobState.SUCCEEDED, 1)
    failed = finished(db, JobState.FAILED, 1)
    running = supervised()
    code, out = jobs(migrated, "ls")
    header, *rows = out.splitlines()
    assert code == 0 and header.split() == ["ID", "STATUS", "PHASE", "TIER", "GPU", "STEPS", "CREATED", "RUN",
                                            "RESULT"]
    assert [r.split()[:2] for r in rows] == [[str(running), "running"], [str(failed), "failed"],
                                             [str(ok), "succeeded"]]
    assert rows[0].split()[2] == "training"
    assert rows[1].endswith("cuda_oom") and rows[2].endswith(f"/out/{ok}.safetensors") and "0:10:00" in rows[2]
    assert [r.split()[0] for r in jobs(migrated, "ls", "--status", "succeeded")[1].splitlines()[1:]] == [str(ok)]
    assert len(jobs(migrated, "ls", "--limit", "1")[1].splitlines()) == 2


def test_ls_marks_a_job_whose_supervisor_is_gone_as_failed(db, migrated):
    job = repo.create_job(db, columns())
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")  # nobody holds its lock
    row = jobs(migrated, "ls")[1].splitlines()[1]
    assert row.split()[1] == "failed" and row.endswith("supervisor_lost")
    assert repo.job_events(db, job.id)[-1].actor == "cli"


def test_show_prints_the_job_and_its_event_history(db, migrated):
    job_id = finished(db, JobState.FAILED, 1)
    code, out = jobs(migrated, "show", str(job_id))
    assert code == 0 and out.startswith(f"job {job_id}\n")
    assert "  status:           failed\n" in out and "  failure:          cuda_oom\n" in out
    assert "  progress:         3/400 steps\n" in out and "  run time:         0:10:00\n" in out
    assert "  error:            CUDA ran out of memory.\n" + " " * 20 + "torch.OutOfMemoryError\n" in out
    events = out.split("events:\n", 1)[1].splitlines()
    assert events[0].split() == ["AT", "FROM", "TO", "ACTOR", "REASON"]
    assert [e.split()[2:5] for e in events[1:]] == [["-", "queued", "api"], ["queued", "running", "supervisor"],
                                                    ["running", "failed", "supervisor"]]


@pytest.mark.slow
def test_show_of_an_unknown_job_fails_with_a_sentence(migrated):
    result = cli(migrated, "jobs", "show", "4242")
    assert result.returncode == 1 and "No job has id 4242." in result.stderr


def test_log_prints_the_whole_log_across_head_and_tail(db, migrated):
    job_id = finished(db, JobState.SUCCEEDED, 1)
    lines = [f"line {i} of the trainer's output" for i in range(40)]
    write_log(migrated, job_id, lines).close()
    assert log_paths(migrated.log_dir, job_id)[1].exists()  # the log really spans two files
    assert jobs(migrated, "log", str(job_id)) == (0, "\n".join(lines) + "\n")


def test_log_follow_prints_until_the_job_has_ended(db, migrated, supervised):
    running = supervised()
    joblog = write_log(migrated, running, ["before"])

    def trainer() -> None:
        for i in range(5):
            time.sleep(0.2)
            joblog.feed(f"step {i}\n")
        joblog.feed("model saved.\n")
        joblog.close()
        repo.transition(db, running, JobState.SUCCEEDED, actor="supervisor")

    writer = threading.Thread(target=trainer)
    writer.start()
    code, out = jobs(migrated, "log", "-f", str(running))
    writer.join()
    assert code == 0 and out == "before\n" + "".join(f"step {i}\n" for i in range(5)) + "model saved.\n"


def test_cancel_flags_a_running_job_once_and_says_so(db, migrated, supervised):
    running = supervised()
    assert jobs(migrated, "cancel", str(running)) == (0, f"job {running}: cancel requested\n")
    assert jobs(migrated, "cancel", str(running)) == (0, f"job {running}: cancel requested\n")
    job = repo.get_job(db, running)
    assert job.status == "running" and job.cancel_requested_at is not None
    flags = [e for e in repo.job_events(db, running) if e.from_status == e.to_status == "running"]
    assert [(e.actor, e.reason) for e in flags] == [("cli", "cancel requested by an operator")]


def test_cancel_of_a_queued_job_cancels_it_at_once(db, migrated):
    job = repo.create_job(db, columns())
    # A queued job without a supervisor is left alone for launch_grace_s: long enough on a loaded machine.
    assert jobs(migrated.with_overrides(launch_grace_s=60), "cancel", str(job.id)) == (0, f"job {job.id}: cancelled\n")
    assert repo.get_job(db, job.id).status == "cancelled"


@pytest.mark.slow
def test_cancel_of_a_finished_job_is_refused(db, migrated):
    job_id = finished(db, JobState.SUCCEEDED, 1)
    with pytest.raises(JobFinished):
        jobs(migrated, "cancel", str(job_id))
    result = cli(migrated, "jobs", "cancel", str(job_id))
    assert result.returncode == 1 and "already ended (succeeded)" in result.stderr


def test_cancel_all_flags_every_active_job_and_leaves_finished_ones_alone(db, migrated, supervised):
    done = finished(db, JobState.SUCCEEDED, 1)
    running = supervised()
    events_before = len(repo.job_events(db, done))
    assert jobs(migrated, "cancel", "--all") == (0, f"job {running}: cancel requested\n")
    assert repo.get_job(db, running).cancel_requested_at is not None
    assert len(repo.job_events(db, done)) == events_before


def test_cancel_all_with_nothing_active_says_so(db, migrated):
    finished(db, JobState.SUCCEEDED, 1)
    assert jobs(migrated, "cancel", "--all") == (0, "no active job\n")


@pytest.mark.slow
def test_cancel_all_wait_stops_real_training_while_the_web_service_is_down(client, host, migrated):
    record = host.root / "record.json"
    set_modes(host.sd_scripts, hang_in="training", record=str(record))
    job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
    wait_for(lambda: client.get(f"/train/{job_id}").get_json()["phase"] == "training", what="training")
    result = cli(migrated, "jobs", "cancel", "--all", "--wait")  # no HTTP: the ledger and the supervisor
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"job {job_id}: cancel requested\njob {job_id}: cancelled\n"
    assert client.get(f"/train/{job_id}").get_json()["status"] == "cancelled"


@pytest.mark.slow
def test_the_cli_logs_one_line_per_event_with_its_job_id_to_stderr(migrated, supervised):
    running = supervised()
    result = cli(migrated, "jobs", "cancel", str(running))
    assert result.returncode == 0 and result.stdout == f"job {running}: cancel requested\n"
    assert f"INFO lora_worker.jobs job={running}: job {running}: cancel requested\n" in result.stderr


def rows_of(migrated, table: str, job_id: int) -> int:
    conn = sqlite3.connect(migrated.database_path)
    try:
        column = "id" if table == "jobs" else "job_id"
        return conn.execute(f"SELECT count(*) FROM {table} WHERE {column} = ?", (job_id,)).fetchone()[0]
    finally:
        conn.close()


def test_prune_forgets_old_finished_jobs_with_events_progress_and_logs_but_never_a_lora(db, migrated, supervised):
    lora = migrated.train_root / "t1" / "output" / "ohwx.safetensors"
    lora.parent.mkdir(parents=True)
    lora.write_bytes(b"a trained LoRA")
    old = finished(db, JobState.SUCCEEDED, 100, lora_path=str(lora), output_dir=str(lora.parent))  # names the file
    old_failed = finished(db, JobState.FAILED, 91)
    recent = finished(db, JobState.SUCCEEDED, 89)
    running = supervised()
    for job_id in (old, old_failed, recent, running):
        write_log(migrated, job_id, [f"output of {job_id}"] * 20).close()
    assert rows_of(migrated, "job_progress", old) == 2

    code, out = jobs(migrated, "prune", "--older-than", "90")
    assert code == 0 and out.startswith("pruned 2 job(s) finished before ") and out.endswith(" and 4 log file(s)\n")
    for gone in (old, old_failed):
        assert [rows_of(migrated, t, gone) for t in ("jobs", "job_events", "job_progress")] == [0, 0, 0]
        assert not any(p.exists() for p in log_paths(migrated.log_dir, gone))
    for kept in (recent, running):
        assert rows_of(migrated, "jobs", kept) == 1 and log_paths(migrated.log_dir, kept)[0].exists()
    assert lora.read_bytes() == b"a trained LoRA"


def test_prune_removes_the_lock_files_moved_aside_logs_and_partial_loras_of_the_jobs_it_forgets(db, migrated):
    from lora_worker.host.fs import identity_of_dir

    out_dir = migrated.train_root / "t1" / "output"
    out_dir.mkdir(parents=True)
    identity = str(identity_of_dir(str(out_dir)))
    old = finished(db, JobState.FAILED, 100, output_dir=str(out_dir), output_dev_ino=identity)
    kept = finished(db, JobState.FAILED, 1, output_dir=str(out_dir), output_dev_ino=identity)
    lora_name = os.path.basename(repo.get_job(db, old).lora_file)
    migrated.lock_dir.mkdir(parents=True, exist_ok=True)
    migrated.log_dir.mkdir(parents=True, exist_ok=True)
    made = {}
    for job_id in (old, kept):
        head, tail = log_paths(migrated.log_dir, job_id)
        made[job_id] = [job_lock_path(migrated, job_id), head.with_name(head.name + ".replaced-17"),
                        tail.with_name(tail.name + ".replaced-17"), out_dir / f"{lora_name}.partial-{job_id}",
                        out_dir / f"{lora_name}.partial-{job_id}-18"]
        for path in made[job_id]:
            path.write_bytes(b"x")
    lora = out_dir / lora_name
    lora.write_bytes(b"a LoRA of another job, finished")  # the LoRA's own name: never pruned
    code, out = jobs(migrated, "prune", "--older-than", "90")
    assert code == 0 and out.endswith(" and 2 log file(s), and 3 lock file(s), partial LoRA(s), state(s) and "
                                      "dataset config(s)\n"), out
    assert not any(p.exists() for p in made[old])
    assert all(p.exists() for p in made[kept]) and lora.exists()


def test_prune_leaves_a_held_lock_file_and_a_partial_lora_in_a_swapped_output_dir(db, migrated):
    out_dir = migrated.train_root / "t1" / "output"
    out_dir.mkdir(parents=True)
    old = finished(db, JobState.FAILED, 100, output_dir=str(out_dir), output_dev_ino="1:2")  # not this directory
    partial = out_dir / f"{os.path.basename(repo.get_job(db, old).lora_file)}.partial-{old}"
    partial.write_bytes(b"x")
    migrated.lock_dir.mkdir(parents=True, exist_ok=True)
    fd = hold_lock(job_lock_path(migrated, old))
    try:
        assert jobs(migrated, "prune", "--older-than", "90")[0] == 0
        assert job_lock_path(migrated, old).exists() and partial.exists()
    finally:
        os.close(fd)


def test_prune_removes_the_states_of_the_jobs_it_forgets_unless_a_kept_job_shares_them(db, migrated):
    """Never through a link, only in the output dir dispatch recorded, and not those of a LoRA file a kept job (a
    resume of it) writes: the states' names are the output name's, not the job's."""
    from lora_worker.host.fs import identity_of_dir
    from tests.helpers.states import write_state

    made = {}
    for train_id in ("t1", "t2", "t3"):
        out_dir = migrated.train_root / train_id / "output"
        out_dir.mkdir(parents=True)
        made[train_id] = (out_dir, str(identity_of_dir(str(out_dir))))
        write_state(out_dir, "ohwx", 150)
        (out_dir / "ohwx-state").mkdir()
        (out_dir / "ohwx-step00000150.safetensors").write_bytes(b"a step LoRA")
    secret = migrated.train_root / "secret"
    secret.mkdir()
    (secret / "keep.txt").write_text("not the job's")
    os.symlink(secret, made["t1"][0] / "ohwx-step00000300-state")  # a link in a state's name: left, not followed

    def old_job(train_id: str, days: float, dev_ino: str | None = None) -> int:
        out_dir, identity = made[train_id]
        return finished(db, JobState.FAILED, days, output_dir=str(out_dir), output_dev_ino=dev_ino or identity,
                        output_name="ohwx", lora_file=str(out_dir / "ohwx.safetensors"))
    old_job("t1", 100)
    old_job("t2", 100)
    old_job("t2", 1)  # its resume, kept: the states are its too
    old_job("t3", 100, dev_ino="1:2")  # the output dir is not the one recorded
    assert jobs(migrated, "prune", "--older-than", "90", "--dry-run")[0] == 0
    assert (made["t1"][0] / "ohwx-step00000150-state").is_dir()
    assert jobs(migrated, "prune", "--older-than", "90")[0] == 0
    t1 = sorted(p.name for p in made["t1"][0].iterdir())
    assert t1 == ["ohwx-step00000150.safetensors", "ohwx-step00000300-state"]  # the link is not a state dir
    assert (secret / "keep.txt").exists()
    for kept in ("t2", "t3"):
        assert {"ohwx-state", "ohwx-step00000150-state"} <= {p.name for p in made[kept][0].iterdir()}


def test_prune_removes_the_dataset_configs_no_launch_named_since_the_cutoff(db, migrated):
    datasets = migrated.state_dir / "datasets"
    datasets.mkdir(parents=True)
    old, recent, named = (datasets / (c * 64 + ".toml") for c in "abc")
    for path in (old, recent, named):
        path.write_text("[[datasets]]\n")
    for path in (old, named):
        os.utime(path, (time.time() - 100 * 86400,) * 2)
    running = repo.create_job(db, columns(argv=["accelerate", "launch", f"--dataset_config={named}"]))
    assert running.status == JobState.QUEUED.value
    code, out = jobs(migrated, "prune", "--older-than", "90")
    assert code == 0 and not old.exists() and recent.exists() and named.exists(), out


def test_prune_dry_run_removes_nothing_and_retention_is_the_default(db, migrated):
    old = finished(db, JobState.CANCELLED, migrated.retention_days + 1)
    write_log(migrated, old, ["x"]).close()
    assert jobs(migrated, "prune", "--dry-run")[1].startswith("would prune 1 job(s)")
    assert rows_of(migrated, "jobs", old) == 1 and log_paths(migrated.log_dir, old)[0].exists()
    assert jobs(migrated, "prune")[1].startswith("pruned 1 job(s)")
    assert rows_of(migrated, "jobs", old) == 0


@pytest.mark.parametrize("argv", [["prune", "--older-than", "-1"], ["prune", "--older-than", "nan"],
                                  ["prune", "--older-than", "inf"], ["prune", "--older-than", "1e10"],
                                  ["show", "0"], ["cancel"], ["cancel", "3", "--all"], ["log", "x"]])
def test_bad_arguments_are_refused_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["jobs", *argv])
    assert refused.value.code == 2 and "usage: lora-worker jobs" in capsys.readouterr().err


def test_show_lists_the_samples_with_their_step_loras_and_writes_the_contact_sheet(db, migrated, tmp_path):
    """What `jobs show` says of a job's sample images (issue 33), from the ledger's rows and the files they name:
    each image's step, prompt, size, hash and step LoRA, and with `--sheet` the contact sheet, a PNG there."""
    import hashlib

    from PIL import Image

    from lora_worker.host.fs import FileId
    from lora_worker.ledger.checkpoints import LORA, CheckpointRow
    from lora_worker.ledger.samples import SamplePass, SampleRow
    from lora_worker.ledger.statements import utcnow
    from tests.helpers.fake_trainer import load_fake_trainer

    out = tmp_path / "out"
    (out / "sample").mkdir(parents=True)
    prompts = [{"prompt": "photo of ohwx woman", "seed": 42}, {"prompt": "ohwx woman, red coat", "seed": 9}]
    job = repo.create_job(db, columns(output_dir=str(out), sample_prompts=prompts,
                                      argv=["accelerate", "--sample_every_n_steps=100"]))
    repo.record_output_identity(db, job.id, str(FileId.of(out.stat())))
    repo.transition(db, job.id, JobState.RUNNING, actor="supervisor")
    rows = []
    for step, index in ((0, 0), (0, 1), (100, 0), (100, 1)):
        num = "e000000" if step == 0 else f"{step:06d}"
        name = f"ohwx_{num}_{index:02d}_20261206051027_{prompts[index]['seed']}.png"
        load_fake_trainer().sd_samples.write_png(str(out / "sample" / name), 64, 64, step + index)
        data = (out / "sample" / name).read_bytes()
        rows.append(SampleRow(name, step, index, prompts[index]["seed"], 64, 64, len(data),
                              hashlib.sha256(data).hexdigest(), utcnow()))
    step_lora = CheckpointRow(LORA, 100, f"{out}/ohwx-step00000100.safetensors", utcnow(), 9, "ab" * 32, True)
    assert repo.update_running(db, job.id, checkpoints=[step_lora],
                               samples=[SamplePass(0, tuple(rows[:2]), 2), SamplePass(100, tuple(rows[2:]), 2)])
    repo.transition(db, job.id, JobState.SUCCEEDED, actor="supervisor")
    sheet = tmp_path / "sheet.png"
    code, text = jobs(migrated, "show", str(job.id), "--sheet", str(sheet))
    assert code == 0, text
    section = text.split("samples: ", 1)[1].split("events:", 1)[0].splitlines()
    assert section[0] == "2 prompts, a pass every 100 steps"
    assert section[1:3] == ["  prompt 0: 'photo of ohwx woman' (seed 42)",
                            "  prompt 1: 'ohwx woman, red coat' (seed 9)"]
    assert [line.split()[:4] for line in section[3:7]] == [
        ["base", "model", "prompt", "0"], ["base", "model", "prompt", "1"], ["step", "100", "prompt", "0"],
        ["step", "100", "prompt", "1"]]
    assert "no step LoRA" in section[3] and f"step LoRA {'ab' * 6} verified" in section[5]
    assert section[7] == f"  contact sheet: {sheet}"
    with Image.open(sheet) as image:
        assert image.format == "PNG" and image.size[1] > image.size[0] // 2  # two rows, two columns

"""Nothing changes under the trainer after the check: right before exec the supervisor looks again, without
following links, and refuses to start (`failed`, `launch_error`) if anything it will hand over has moved."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lora_worker.host import sandbox
from lora_worker.ledger import repository as repo
from lora_worker.run.local import launch_supervisor
from lora_worker.run.prelaunch import what_moved
from lora_worker.states import TERMINAL_STATES
from tests.helpers import png_bytes, set_modes, wait_for

FOLDER = "10_ohwx woman"
TERMINAL = {s.value for s in TERMINAL_STATES}
needs_bwrap = pytest.mark.skipif(sandbox.bwrap_executable() is None, reason="bubblewrap is not installed")


@pytest.fixture
def accepted(api, host, launches, db):
    """A job accepted by the real dispatch whose supervisor has not started: the recording launcher holds it."""
    response = api.post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()
    return repo.get_job(db, response.get_json()["worker_job_id"])


def swap_for_link(path: Path) -> Path:
    """Move the directory aside, copy it outside the train root, and put a symlink to the copy in its place."""
    outside = path.parent.parent.parent / f"outside-{path.name}"
    shutil.copytree(path, outside, symlinks=True)
    shutil.rmtree(path)
    path.symlink_to(outside)
    return outside


def test_nothing_moved_lets_the_trainer_start(accepted):
    assert what_moved(accepted) is None


@pytest.mark.parametrize("which", ["dataset", "output", "kohya"])
def test_a_directory_swapped_for_a_symlink_is_refused(accepted, host, which):
    path = {"dataset": host.dataset, "output": host.dataset.parent / "output",
            "kohya": host.dataset / FOLDER}[which]
    swap_for_link(path)
    reason = what_moved(accepted)
    assert reason is not None and "cannot be opened without following links" in reason and "symlink" in reason


@pytest.mark.parametrize("which", ["dataset", "output", "kohya"])
def test_a_directory_replaced_by_another_real_directory_is_refused_by_identity(accepted, host, which):
    path = {"dataset": host.dataset, "output": host.dataset.parent / "output",
            "kohya": host.dataset / FOLDER}[which]
    aside = path.with_name(path.name + ".old")
    path.rename(aside)
    shutil.copytree(aside, path)  # same name, same content, another inode
    reason = what_moved(accepted)
    assert reason is not None and "is not the directory that was checked" in reason


def test_a_parent_directory_swapped_for_a_symlink_is_refused(accepted, host):
    train_dir = host.dataset.parent
    moved = train_dir.with_name("t1-moved")
    train_dir.rename(moved)  # same inodes below, now reached through a link
    train_dir.symlink_to(moved)
    reason = what_moved(accepted)
    assert reason is not None and f"{train_dir} is a symlink" in reason


def test_a_new_subset_folder_after_the_check_is_refused(accepted, host):
    (host.dataset / "+3_extra").mkdir()
    (host.dataset / "+3_extra" / "a.png").write_bytes(png_bytes())
    reason = what_moved(accepted)
    assert reason is not None and "'+3_extra'" in reason and "sd-scripts would train on" in reason


@pytest.mark.parametrize("name", ["img0.png", "img0.txt"])
def test_an_image_or_caption_turned_into_a_link_after_the_check_is_refused(accepted, host, name):
    target = host.dataset / FOLDER / name
    target.unlink()
    target.symlink_to("/etc/hostname")
    reason = what_moved(accepted)
    assert reason is not None and f"{FOLDER}/{name} is now a symlink" in reason


def test_a_caption_turned_into_a_fifo_after_the_check_is_refused(accepted, host):
    target = host.dataset / FOLDER / "img1.txt"
    target.unlink()
    os.mkfifo(target)
    assert "is now a FIFO" in what_moved(accepted)


def test_a_lora_path_planted_after_the_check_is_refused(accepted, host):
    (host.dataset.parent / "output" / "ohwx_lora.safetensors").symlink_to(host.root / "stolen.safetensors")
    reason = what_moved(accepted)
    assert reason is not None and "appeared in output_dir after the job was accepted (a symlink)" in reason


@pytest.mark.parametrize("plant", ["link", "file"])
def test_a_sample_folder_that_is_not_a_folder_is_refused_and_a_real_one_kept(accepted, host, tmp_path, plant):
    """sd-scripts writes its sample images into <output_dir>/sample: a link there would take them elsewhere."""
    sample = host.dataset.parent / "output" / "sample"
    sample.mkdir()  # a resume's: the original's images are there
    assert what_moved(accepted) is None
    sample.rmdir()
    if plant == "link":
        (tmp_path / "elsewhere").mkdir()
        sample.symlink_to(tmp_path / "elsewhere")
    else:
        sample.write_bytes(b"")
    reason = what_moved(accepted)
    assert reason is not None and "not the folder of the sample images" in reason


def test_a_row_from_before_the_identities_were_recorded_is_still_checked_for_links(accepted, host):
    # A job accepted before migration 0005 has no identities; the walk without links still applies.
    accepted.dataset_dev_ino = accepted.kohya_dev_ino = accepted.output_dev_ino = None
    assert what_moved(accepted) is None
    swap_for_link(host.dataset.parent / "output")
    assert "symlink" in what_moved(accepted)


# -- the real supervisor --------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("which", ["dataset", "output"])
def test_a_swap_after_the_202_ends_the_job_as_launch_error_and_the_trainer_never_runs(accepted, host, db, which):
    record = host.root / "record.json"
    set_modes(host.sd_scripts, record=str(record))
    outside = swap_for_link(host.dataset if which == "dataset" else host.dataset.parent / "output")
    launch_supervisor(accepted.id, host.settings)
    done = wait_for(lambda: (j := repo.get_job(db, accepted.id)).status in TERMINAL and j, timeout=30,
                    what="the job to end")
    assert (done.status, done.failure_class) == ("failed", "launch_error"), done.error
    assert "Refusing to start the trainer" in done.error and "symlink" in done.error
    assert not record.exists(), "the trainer ran"
    assert not list(outside.glob("*.safetensors")), "something was written outside"


def test_a_folder_that_can_no_longer_be_listed_is_a_reason_not_a_supervisor_error(accepted, monkeypatch):
    from lora_worker.host import fs

    def denied(dir_fd: int) -> list:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fs, "list_entries", denied)
    assert what_moved(accepted) == "the dataset or output_dir can no longer be listed (Permission denied)"


# -- the window between the last look and the mount ------------------------------------------------------------

class WithArgv:
    """The accepted job, running `argv` instead of its trainer."""

    def __init__(self, job, argv: list[str]) -> None:
        self.job, self.argv = job, argv

    def __getattr__(self, name: str):
        return getattr(self.job, name)


def in_the_sandbox_after(job, settings, swap, script: str) -> tuple[int | None, str]:
    """The real seam, as the runner uses it: the last look, then `swap` (the attacker, in the window), then the
    command the sandbox mounts and a real bwrap running `sh -c script dataset_dir output_dir` in it."""
    from lora_worker.run.seam import SupervisorHost

    seam = SupervisorHost()
    assert seam.what_moved(job) is None
    swap()
    argv = ["sh", "-c", script, "sh", job.dataset_dir, job.output_dir]
    trainer = seam.spawn(seam.command_for(WithArgv(job, argv), settings), cwd=settings.sd_scripts_dir,
                         env={"PATH": "/usr/bin:/bin"})
    out = b""
    while (chunk := trainer.read(5.0)) is not None:
        out += chunk
    trainer.close()
    return trainer._popen.wait(10), out.decode(errors="replace")


def other_train_id(host) -> Path:
    other = host.settings.train_root / "t2" / "dataset"
    (other / "10_other person").mkdir(parents=True)
    (other / "10_other person" / "secret.txt").write_text("another train id's caption")
    return other


@pytest.mark.slow
@needs_bwrap
@pytest.mark.parametrize("how", ["symlink", "rename"])
def test_a_dataset_swapped_after_the_check_is_not_what_the_sandbox_mounts(accepted, host, how):
    other = other_train_id(host)
    settings = host.settings.with_overrides(sandbox="bwrap")

    def swap() -> None:
        host.dataset.rename(host.dataset.with_name("dataset.checked"))
        if how == "symlink":
            host.dataset.symlink_to(other)
        else:
            other.rename(host.dataset)  # another train id's dataset, moved into place under our name

    rc, out = in_the_sandbox_after(accepted, settings, swap, 'ls "$1"; cat "$1"/*/secret.txt')
    assert "another train id's caption" not in out and "10_other person" not in out, out
    assert FOLDER in out, out  # the dataset the check saw, wherever it was moved to


@pytest.mark.slow
@needs_bwrap
@pytest.mark.parametrize("how", ["symlink", "rename"])
def test_an_output_dir_swapped_after_the_check_is_not_mounted_read_write(accepted, host, how):
    foreign = host.root / "foreign"
    foreign.mkdir()
    output = host.dataset.parent / "output"
    settings = host.settings.with_overrides(sandbox="bwrap")

    def swap() -> None:
        output.rename(output.with_name("output.checked"))
        if how == "symlink":
            output.symlink_to(foreign)
        else:
            foreign.rename(output)

    rc, out = in_the_sandbox_after(accepted, settings, swap, 'echo written > "$2/evil.txt" && echo done')
    assert rc == 0 and "done" in out, out
    assert (output.with_name("output.checked") / "evil.txt").exists()  # the checked directory got it
    assert not (foreign / "evil.txt").exists() and not (output / "evil.txt").exists(), "a foreign dir was written"


# -- the dataset config the argv names (dispatch/presentation.py) ------------------------------------------------

def config_of(accepted) -> Path:
    (config,) = [a.split("=", 1)[1] for a in accepted.argv if a.startswith("--dataset_config=")]
    return Path(config)


def test_the_dataset_config_is_checked_and_held_for_the_sandbox(accepted, host):
    """The file dispatch wrote is this job's kohya folder and class tokens; its descriptor is held (and bound)."""
    from lora_worker.run.prelaunch import check

    checked = check(accepted)
    try:
        assert checked.moved is None and config_of(accepted) in checked.held
        assert os.fstat(checked.held[config_of(accepted)]).st_ino == config_of(accepted).stat().st_ino
    finally:
        checked.close()


@pytest.mark.parametrize("damage, said", [
    (lambda p: p.unlink(), "cannot be opened"),
    (lambda p: (p.unlink(), p.symlink_to("/etc/passwd")), "symlink"),
    (lambda p: p.write_bytes(p.read_bytes().replace(b"num_repeats = ", b"num_repeats = 1")), "not the config of"),
    (lambda p: p.write_bytes(p.read_bytes().replace(b"10_ohwx", b"11_ohwx")), "not the config of"),
    (lambda p: p.write_bytes(p.read_bytes().replace(b"ohwx woman'\n", b"ohwx man'\n")), "not the config of"),
    (lambda p: p.write_bytes(p.read_bytes() + b"shuffle_caption = true\n"), "not the config of"),
])
def test_a_dataset_config_gone_replaced_or_changed_stops_the_start(accepted, damage, said):
    damage(config_of(accepted))
    reason = what_moved(accepted)
    assert reason is not None and reason.startswith(f"the dataset config {config_of(accepted)}") and said in reason


def test_a_row_given_train_data_dir_has_no_config_to_check(accepted):
    accepted.argv = [f"--train_data_dir={accepted.dataset_dir}" if a.startswith("--dataset_config=") else a
                     for a in accepted.argv]
    config_of_row = [a for a in accepted.argv if a.startswith("--dataset_config=")]
    assert config_of_row == [] and what_moved(accepted) is None

"""Issue 32 item 2: the resume verdict checks in order of cost (the ledger's rows, the step arithmetic, names, kinds
and sizes, the fingerprint, and the archives' CRCs last), keeps a pass by the files' identities, and answers within
one bound of bytes and time whatever is planted in the output directory (dispatch/resumable.py,
host/train_state.py, host/state_archives.py)."""
from __future__ import annotations

import os
import zipfile

import pytest

from lora_worker.dispatch.resumable import verdict
from lora_worker.host import state_archives, train_state
from lora_worker.ledger import repository as repo
from lora_worker.states import FailureClass
from tests.helpers.states import interrupted, write_zip


@pytest.fixture
def job_id(api, host) -> int:
    response = api.post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()
    return response.get_json()["worker_job_id"]


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The archives whose members the verdict reads through (the costly part), in order."""
    seen: list[str] = []
    real = state_archives.read_through

    def counted(dir_fd: int, name: str, budget: state_archives.Budget):
        seen.append(name)
        return real(dir_fd, name, budget)
    monkeypatch.setattr(state_archives, "read_through", counted)
    return seen


def codes(found) -> list[str]:
    return [p.code for p in found.reasons]


def check(db, settings, job_id, **kw):
    return verdict(db, settings, repo.get_job(db, job_id), **kw)


def test_an_ending_no_resume_follows_reads_no_state(db, settings, job_id, reads, monkeypatch):
    interrupted(db, settings, job_id, FailureClass.TRAINER_CRASHED)
    monkeypatch.setattr(train_state, "check_state", lambda *a, **k: pytest.fail("a state was opened"))
    assert codes(check(db, settings, job_id)) == ["failure_recurs"] and reads == []


def test_planted_states_are_refused_by_their_names_before_anything_is_opened(db, settings, job_id, reads,
                                                                            monkeypatch):
    """Hundreds of `<name>-stepNNNNNNNN-state` directories the run never said it saved: refused by the ledger's
    rows and the step arithmetic alone; only the state the run saved is opened, and only it is read through."""
    output = interrupted(db, settings, job_id, steps=(4,))
    for step in range(5, 400):
        (output / f"ohwx_lora-step{step:08d}-state").mkdir()
    opened: list[str] = []
    real = train_state.check_state
    monkeypatch.setattr("lora_worker.dispatch.resumable.check_state",
                        lambda out, name, **kw: (opened.append(name), real(out, name, **kw))[1])
    found = check(db, settings, job_id)
    assert found.resumable and found.from_step == 4
    assert set(codes(found)) == {"state_not_seen"} and len(found.reasons) == 395
    assert opened == ["ohwx_lora-step00000004-state"] and reads == list(train_state.ARCHIVES)


def test_a_changed_fingerprint_is_found_before_any_archive_is_read(db, settings, job_id, reads):
    interrupted(db, settings, job_id)
    found = check(db, settings.with_overrides(cpu_threads=settings.cpu_threads + 1), job_id)
    assert codes(found) == ["fingerprint_argv"] and reads == []


def test_a_truncated_archive_is_refused_by_its_directory_before_any_crc_is_read(db, settings, job_id, reads):
    output = interrupted(db, settings, job_id)
    optimizer = output / "ohwx_lora-step00000004-state" / "optimizer.bin"
    os.truncate(optimizer, optimizer.stat().st_size // 2)
    found = check(db, settings, job_id)
    assert found.from_step == 2 and codes(found) == ["state_archive_corrupt"]
    assert reads == list(train_state.ARCHIVES)  # state 2's, read through once; state 4's not at all


def test_a_pass_is_kept_by_the_files_identities_and_a_changed_file_is_read_again(db, settings, job_id, monkeypatch):
    output = interrupted(db, settings, job_id, steps=(2,))
    assert check(db, settings, job_id).resumable
    real_open = zipfile.ZipFile.open

    def no_member_read(self, name, mode="r", *a, **kw):
        if mode == "w":
            return real_open(self, name, mode, *a, **kw)  # the test's own writing
        raise zipfile.BadZipFile(f"{getattr(name, 'filename', name)} was read again")
    monkeypatch.setattr(zipfile.ZipFile, "open", no_member_read)
    assert check(db, settings, job_id).resumable  # the GET before a resume and the POST read each archive once
    scheduler = output / "ohwx_lora-step00000002-state" / "scheduler.bin"
    write_zip(scheduler)  # rewritten: another ctime, so no longer the file that passed
    found = check(db, settings, job_id)
    assert codes(found) == ["state_archive_corrupt"] and "archive/data.pkl was read again" in found.reasons[0].message
    assert "scheduler.bin" in found.reasons[0].message
    monkeypatch.setattr(zipfile.ZipFile, "open", real_open)
    assert check(db, settings, job_id).resumable


def test_archives_too_large_to_read_are_refused_by_their_sizes_alone(db, settings, job_id, reads):
    """A planted state of 5 GiB (sparse) is not verified, and not a byte of it is read."""
    output = interrupted(db, settings, job_id, steps=(2,))
    optimizer = output / "ohwx_lora-step00000002-state" / "optimizer.bin"
    with optimizer.open("r+b") as fh:
        fh.truncate(5 << 30)
    found = check(db, settings, job_id)
    assert codes(found) == ["state_unverifiable"] and "what a check reads at most" in found.reasons[0].message
    assert reads == []


def test_an_archive_listing_more_members_than_a_torch_archive_is_not_parsed(db, settings, job_id, monkeypatch,
                                                                           reads):
    output = interrupted(db, settings, job_id, steps=(2,))
    monkeypatch.setattr(state_archives, "MAX_MEMBERS", 1)  # the helper's archives hold 2
    found = check(db, settings, job_id)
    assert codes(found) == ["state_unverifiable"] and "lists more than 1 members" in found.reasons[0].message
    assert reads == [] and (output / "ohwx_lora-step00000002-state").is_dir()


def test_one_time_bound_for_the_whole_verdict_however_many_states_it_reads(db, settings, job_id, monkeypatch):
    """Each archive read takes 50 s of a fake clock: the first state's reading runs out of the 120 s, and the
    older state is not read at all: the verdict's reading stops at its bound, whatever is planted."""
    interrupted(db, settings, job_id, steps=(2, 4))
    now = [0.0]

    def clock() -> float:
        now[0] += 50.0
        return now[0]
    found = check(db, settings, job_id, clock=clock)
    assert not found.resumable and codes(found) == ["state_unverifiable", "state_unverifiable"]
    assert "was not read whole within 120 s" in found.reasons[0].message
    assert "was not read: the check's 120 s were spent" in found.reasons[1].message
    assert now[0] <= 250.0  # a handful of clock reads: nothing read once the bound was spent


def declared(path) -> int:
    with zipfile.ZipFile(path) as archive:
        return sum(m.file_size for m in archive.infolist())


def test_one_byte_bound_for_the_whole_verdict(db, settings, job_id, monkeypatch):
    """The newest state fails its last archive's CRC after its others were read through; the older state's
    archives then no longer fit what is left of the one bound of bytes: not verified, not read."""
    output = interrupted(db, settings, job_id, steps=(2, 4))
    newest = output / "ohwx_lora-step00000004-state"
    rng = newest / "random_states_0.pkl"
    data = bytearray(rng.read_bytes())
    data[bytes(data).index(b"\x80\x02}q") + 5] ^= 0xFF  # inside the stored data.pkl member: its CRC fails
    rng.write_bytes(bytes(data))
    per_state = sum(declared(newest / name) for name in train_state.ARCHIVES)
    monkeypatch.setattr(state_archives, "MAX_ARCHIVE_BYTES", 2 * per_state - 1)
    found = check(db, settings, job_id)
    assert not found.resumable and codes(found) == ["state_archive_corrupt", "state_unverifiable"]
    assert "CRC" in found.reasons[0].message and "random_states_0.pkl has more than" in found.reasons[1].message

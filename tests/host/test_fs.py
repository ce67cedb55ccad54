"""The train root is read as a hostile party may have left it: no link followed, no open that blocks."""
from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from lora_worker.host import fs


def test_a_directory_is_opened_and_named_by_its_identity(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    ident = fs.identity_of_dir(str(tmp_path / "a" / "b"))
    st = os.stat(tmp_path / "a" / "b")
    assert ident == fs.FileId(st.st_dev, st.st_ino) and fs.FileId.parse(str(ident)) == ident


@pytest.mark.parametrize("where", ["last", "middle"])
def test_a_symlink_in_any_component_of_a_directory_path_is_refused(tmp_path, where):
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    path = tmp_path / "link" if where == "last" else tmp_path / "link" / "inner"
    with pytest.raises(fs.Refused, match=f"{tmp_path / 'link'} is a symlink, not a directory"):
        fs.open_dir(str(path))


def test_a_file_where_a_directory_is_expected_is_refused_by_kind(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(fs.Refused, match="is a regular file, not a directory"):
        fs.open_dir(str(tmp_path / "f"))


def test_a_missing_directory_is_file_not_found_not_a_refusal(tmp_path):
    with pytest.raises(FileNotFoundError):
        fs.open_dir(str(tmp_path / "nope"))


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "FIFO"),
    (lambda p: p.symlink_to("/dev/zero"), "symlink"),
    (lambda p: p.symlink_to("/nonexistent"), "symlink"),
    (lambda p: p.mkdir(), "directory"),
])
def test_only_a_regular_file_is_opened_and_a_fifo_does_not_block(tmp_path, make, kind):
    make(tmp_path / "entry")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    done: list[BaseException] = []

    def attempt() -> None:
        try:
            fs.open_regular(dir_fd, "entry")
        except OSError as exc:
            done.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(5)
    os.close(dir_fd)
    assert not worker.is_alive(), "open_regular blocked"
    assert isinstance(done[0], fs.Refused) and kind in str(done[0])


def test_a_regular_file_is_opened_with_its_stat(tmp_path):
    (tmp_path / "cap.txt").write_bytes(b"hello")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd, st = fs.open_regular(dir_fd, "cap.txt")
    finally:
        os.close(dir_fd)
    try:
        assert stat.S_ISREG(st.st_mode) and os.read(fd, 10) == b"hello"
        assert fs.real_path_of(fd) == str(tmp_path / "cap.txt")
    finally:
        os.close(fd)


def test_a_capped_read_refuses_an_endless_file_quickly():
    fd = os.open("/dev/zero", os.O_RDONLY)  # what a caption linked to /dev/zero would give, were it opened
    try:
        started = time.monotonic()
        with pytest.raises(fs.Refused, match="larger than 1024 bytes"):
            fs.read_capped(fd, 1024)
        assert time.monotonic() - started < 1.0
    finally:
        os.close(fd)


def test_a_capped_read_reads_no_more_than_one_byte_past_the_cap():
    r, w = os.pipe()
    try:
        os.write(w, b"x" * 10_000)
        with pytest.raises(fs.Refused):
            fs.read_capped(r, 1024)
        os.close(w)
        w = -1
        left = b""
        while block := os.read(r, 65536):
            left += block
        assert len(left) == 10_000 - 1025
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_capped_read_returns_a_file_at_the_cap(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 1024)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert fs.read_capped(fd, 1024) == b"x" * 1024
    finally:
        os.close(fd)


def test_listing_names_each_entry_by_its_own_kind_never_its_target(tmp_path):
    (tmp_path / "dangling").symlink_to("/nonexistent")
    (tmp_path / "to-dir").symlink_to(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        kinds = {name: fs.kind_of(st.st_mode) for name, st in fs.list_entries(dir_fd)}
    finally:
        os.close(dir_fd)
    assert kinds == {"dangling": "symlink", "fifo": "FIFO", "to-dir": "symlink"}


def test_make_dirs_creates_group_writable_dirs_that_inherit_setgid(tmp_path):
    os.chmod(tmp_path, 0o2770)
    ident = fs.make_dirs(str(tmp_path / "t1" / "output"))
    st = os.stat(tmp_path / "t1" / "output")
    assert fs.FileId.of(st) == ident
    assert stat.S_IMODE(st.st_mode) == 0o2770 and stat.S_IMODE(os.stat(tmp_path / "t1").st_mode) == 0o2770


def test_make_dirs_does_not_create_through_a_planted_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "t1").symlink_to(outside)
    with pytest.raises(fs.Refused, match="symlink"):
        fs.make_dirs(str(tmp_path / "root" / "t1" / "output"))
    assert list(outside.iterdir()) == []


def test_make_dirs_keeps_an_existing_directory_as_it_is(tmp_path):
    (tmp_path / "out").mkdir(mode=0o755)
    os.chmod(tmp_path / "out", 0o755)
    fs.make_dirs(str(tmp_path / "out"))
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o755


@pytest.mark.parametrize("path, problem", [
    ("/" + "a" * (fs.NAME_MAX + 1), "component longer than"),
    ("/x" * (fs.PATH_MAX // 2), "longer than the system's limit"),
])
def test_a_path_the_os_would_refuse_as_too_long_is_named_before_use(path, problem):
    assert problem in fs.check_length(path)


def test_a_path_within_the_limits_passes_the_length_check():
    assert fs.check_length("/" + "a" * fs.NAME_MAX + "/b") is None


def test_no_descriptor_is_leaked_by_a_refused_walk(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(fs.Refused):
            fs.open_dir(str(tmp_path / "link" / "x"))
        with pytest.raises(FileNotFoundError):
            fs.open_dir(str(tmp_path / "nope" / "x"))
    assert len(os.listdir("/proc/self/fd")) == before


def test_relative_paths_are_not_walked():
    with pytest.raises(ValueError):
        fs.open_dir("relative/path")


"""The run log: redraws collapsed, bounded with head and tail, followed by logical offset without loss."""
from __future__ import annotations

import pytest

from lora_worker.transcript.logfile import REDRAW_EVERY_S, JobLog
from lora_worker.transcript.logreader import LogReader


def test_redraws_collapse_to_what_a_terminal_would_show(tmp_path):
    # One merged pipe: a log line written after an unterminated redraw lands on the bar's line, as on a terminal.
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    log.feed("\rsteps:   0%|  | 0/3 [00:00<?, ?it/s]\rsteps:  33%|█ | 1/3 [00:01<00:02, 1.0s/it]")
    log.feed("\nepoch 1/1\n")
    log.feed("\rsteps:  66%|█▌| 2/3 [00:02<00:01, 1.0s/it]\rsaving checkpoint: /out/a.safetensors\n")
    log.feed("\rsteps: 100%|██| 3/3 [00:03<00:00, 1.0s/it, avr_loss=0.9]\r   \n")  # tqdm's pad spaces
    log.note("done")
    log.close()
    assert (tmp_path / "job-1.log").read_text() == (
        "steps:  33%|█ | 1/3 [00:01<00:02, 1.0s/it]\nepoch 1/1\nsaving checkpoint: /out/a.safetensors\n"
        "steps: 100%|██| 3/3 [00:03<00:00, 1.0s/it, avr_loss=0.9]\n[lora-worker] done\n")


def test_the_error_tail_keeps_the_same_segment_of_a_redrawn_line_as_the_log(tmp_path):
    from lora_worker.transcript.output import TrainerOutput

    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    output = TrainerOutput(log, lambda phase, step: None)
    text = b"\rsteps: 100%|##| 3/3 [00:03<00:00, 1.0s/it]\r   \nTraceback: boom\r\n"
    output.consume(text, 0.0)
    output.end()
    log.close()
    assert output.tail == (tmp_path / "job-1.log").read_text().splitlines() == [
        "steps: 100%|##| 3/3 [00:03<00:00, 1.0s/it]", "Traceback: boom"]


def test_an_open_bar_is_copied_into_the_log_now_and_then(tmp_path):
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    log.tick(now=1e9)  # the first tick starts the interval, in the ticker's clock
    log.feed("\rsteps:  10%|█ | 10/100 [00:10<01:30, 1.0s/it, avr_loss=0.5]")
    log.tick(now=1e9 + REDRAW_EVERY_S - 1)  # too soon
    log.tick(now=1e9 + REDRAW_EVERY_S)
    log.feed("\rsteps:  11%|█ | 11/100 [00:11<01:29, 1.0s/it, avr_loss=0.5]")
    log.tick(now=1e9 + REDRAW_EVERY_S + 1)  # too soon for another copy
    log.close()
    text = (tmp_path / "job-1.log").read_text().splitlines()
    assert text == ["steps:  10%|█ | 10/100 [00:10<01:30, 1.0s/it, avr_loss=0.5]",
                    "steps:  11%|█ | 11/100 [00:11<01:29, 1.0s/it, avr_loss=0.5]"]


@pytest.mark.parametrize("start", [0.0, 1000.0, 1e9])
def test_the_copy_interval_is_counted_in_the_tickers_clock_whatever_its_origin(tmp_path, start):
    """A fake clock at 1000 s read against time.monotonic() on a host up for less than that copied the bar at the
    first tick (the Slurm poller's restart test failed on a freshly booted machine); one far ahead never did."""
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    log.feed("\rsteps:  10%|█ | 10/100 [00:10<01:30, 1.0s/it, avr_loss=0.5]")
    log.tick(now=start)
    log.tick(now=start + REDRAW_EVERY_S - 1)
    too_soon = (tmp_path / "job-1.log").read_text()
    log.tick(now=start + REDRAW_EVERY_S)
    copied = (tmp_path / "job-1.log").read_text()
    log.close()
    assert (too_soon, copied) == ("", "steps:  10%|█ | 10/100 [00:10<01:30, 1.0s/it, avr_loss=0.5]\n")


def test_an_unterminated_last_redraw_is_kept_at_the_end(tmp_path):
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    log.feed("\rsteps:   0%|          | 0/50 [00:00<?, ?it/s]")
    log.close()
    assert (tmp_path / "job-1.log").read_text() == "steps:   0%|          | 0/50 [00:00<?, ?it/s]\n"


def test_size_is_bounded_keeping_head_and_tail(tmp_path):
    log = JobLog(tmp_path, 7, head_bytes=1000, tail_bytes=2000)
    lines = [f"line {i:05d}\n" for i in range(3000)]  # 11 bytes each, 33 kB in all
    for line in lines:
        log.feed(line)
    log.close()
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert on_disk < 1000 + 2 * 2000 + 100
    reader = LogReader(tmp_path, 7)
    assert reader.size() == 33000
    assert reader.read_from(0, 100).text.startswith("line 00000\n")
    assert reader.tail_lines(3).text == "".join(lines[-3:])


def test_following_by_offset_sees_every_byte_once_or_is_told_what_it_skipped(tmp_path):
    log = JobLog(tmp_path, 3, head_bytes=500, tail_bytes=400)
    reader = LogReader(tmp_path, 3)
    seen, offset, skipped = "", 0, 0
    written = ""
    for i in range(400):
        line = f"{i:04d} abcdef\n"
        written += line
        log.feed(line)
        if i % 7 == 0:
            chunk = reader.read_from(offset, 10_000)
            seen += chunk.text
            offset, skipped = chunk.offset, skipped + chunk.skipped
    log.close()
    chunk = reader.read_from(offset, 10_000)
    seen += chunk.text
    assert chunk.offset == len(written) == reader.size()
    assert skipped == 0 and seen == written  # read often enough: nothing missed, nothing twice
    late = reader.read_from(600, 10_000)  # a follower that stopped at byte 600 has lost the middle
    assert late.skipped > 0 and written.endswith(late.text) and late.offset == len(written)


def test_a_full_disk_never_stops_the_writer(tmp_path, monkeypatch):
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)

    def boom(data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(log._head, "write", boom)
    log.feed("a line\n")
    log.close()
    assert log.write_errors == 1


def test_a_compaction_that_fails_on_a_full_disk_leaves_the_log_writable(tmp_path, monkeypatch):
    from lora_worker.transcript import logfile

    log = JobLog(tmp_path, 4, head_bytes=100, tail_bytes=200)
    real_open = logfile.open_log  # every file of the log dir is opened there (no link followed, never blocking)

    def full_for_the_copy(path, flags=0):  # 0: O_RDONLY
        if path.suffix == ".tmp":
            raise OSError(28, "No space left on device")
        return real_open(path, flags)

    monkeypatch.setattr(logfile, "open_log", full_for_the_copy)
    written = [f"line {i:04d}\n" for i in range(100)]  # 10 bytes each: compaction is due many times over
    for line in written:
        log.feed(line)
    assert log.write_errors > 0 and not (tmp_path / "job-4.tail.tmp").exists()
    monkeypatch.undo()  # space again: the next compaction goes through
    for line in written:
        log.feed(line)
    log.close()
    reader = LogReader(tmp_path, 4)
    assert reader.size() == 2 * 1000
    assert reader.tail_lines(3).text == "".join(written[-3:])


def test_a_read_limit_inside_a_character_never_splits_it(tmp_path):
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    log.feed("steps: 100%|██████████| 3/3\n")
    log.close()
    reader, offset, text = LogReader(tmp_path, 1), 0, ""
    while True:
        chunk = reader.read_from(offset, 14)  # "steps: 100%|" is 12 bytes; each "█" is 3
        if not chunk.text:
            break
        assert "\ufffd" not in chunk.text and chunk.offset == offset + len(chunk.text.encode())
        offset, text = chunk.offset, text + chunk.text
    assert text == "steps: 100%|██████████| 3/3\n"


def test_a_bar_left_open_then_blanked_by_pad_spaces_in_a_later_chunk_is_what_the_line_keeps(tmp_path):
    # tqdm's pad after a shorter redraw can come in the next read: the line still shows the redraw.
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    log.feed(b"\rsteps: 100%|##| 3/3 [00:03<00:00, 1.0s/it]")
    log.feed(b"\r   ")
    log.feed(b"\nTraceback: boom\n\rsteps:  50%|#| 1/2")
    log.feed(b"\r  ")
    log.close()
    assert (tmp_path / "job-1.log").read_text() == (
        "steps: 100%|##| 3/3 [00:03<00:00, 1.0s/it]\nTraceback: boom\nsteps:  50%|#| 1/2\n")


def test_each_chunk_is_one_write_however_many_lines_it_holds(tmp_path, monkeypatch):
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    writes = []
    real = log._head.write
    monkeypatch.setattr(log._head, "write", lambda data: writes.append(bytes(data)) or real(data))
    log.feed(b"".join(b"line %d\r\rline %d again\n" % (i, i) for i in range(500)) + b"open")
    assert len(writes) == 1 and writes[0].count(b"\n") == 500
    log.close()

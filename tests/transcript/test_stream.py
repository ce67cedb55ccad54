"""The supervisor's output path on bytes (transcript/output.py, transcript/parser.py, transcript/logfile.py): the
same progress, loss curve and run log however the pipe cuts the stream, and never a marker missed for speed."""
from __future__ import annotations

import random
import re
import re._constants as sre_constants
import re._parser as sre_parse
from pathlib import Path

import pytest

from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.output import TrainerOutput
from lora_worker.transcript.markers import INNER_LITERALS, MARKERS, MESSAGE_STARTS, message_starts
from lora_worker.transcript.parser import Parser
from lora_worker.transcript.redraws import BAR, LOSS
from tests.helpers.captures import CAPTURES, stream



def read(data: bytes, cuts: list[int], tmp_path: Path) -> tuple[object, ...]:
    """`data` through TrainerOutput, cut at `cuts`: the progress, the loss curve as the ledger keeps it (a step
    seen again updates its loss) and the run log."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = JobLog(tmp_path, 1, head_bytes=1 << 20, tail_bytes=1 << 20)
    output = TrainerOutput(log, lambda phase, step: None)
    curve: dict[int, float | None] = {}
    for a, b in zip([0, *cuts], [*cuts, len(data)]):
        output.consume(data[a:b], 0.0)
        curve.update(output.parser.take_points())
    output.end()
    curve.update(output.parser.take_points())
    log.close()
    p = output.progress
    return (p.phase, p.step, p.total_steps, p.loss, p.rate, p.eta_s, sorted(p.flags), p.signal, p.inner_exit,
            p.checkpoints, curve, (tmp_path / "job-1.log").read_text(), output.tail)


def random_cuts(size: int, rng: random.Random, largest: int) -> list[int]:
    cuts, pos = [], 0
    while (pos := pos + rng.randint(1, largest)) < size:
        cuts.append(pos)
    return cuts


def naive_curve(data: bytes) -> dict[int, float | None]:
    """Every `steps` redraw read one by one, as a terminal shows them: each step's newest loss."""
    curve: dict[int, float | None] = {}
    loss = None
    for segment in re.split(rb"[\r\n]", data):
        m = BAR.match(segment.decode("utf-8", "replace"))
        if m:
            found = LOSS.search(m[7] or "")
            loss = float(found[1]) if found else loss
            if int(m[1]) > 0:
                curve[int(m[1])] = loss
    return curve


@pytest.mark.parametrize("name", CAPTURES)
def test_any_chunking_of_a_real_capture_reads_as_the_whole_stream(name, tmp_path):
    data = stream(name)
    whole = read(data, [], tmp_path / "whole")
    assert whole[10] == naive_curve(data)  # the curve has every step the bar showed, with its newest loss
    rng = random.Random(name)
    chunkings = {"bytes": list(range(1, len(data))),
                 "every line end": sorted({i + d for i, c in enumerate(data) if c in b"\r\n" for d in (0, 1)} - {0})}
    for n in range(12):
        chunkings[f"random {n}"] = random_cuts(len(data), rng, (3, 17, 90, 700)[n % 4])
    for how, cuts in chunkings.items():
        assert read(data, [c for c in cuts if 0 < c < len(data)], tmp_path / how) == whole, how


def flood(size: int, *, lines: bool) -> bytes:
    from bench.stream import flood_chunks  # what the stream benchmark's emitter writes
    return b"".join(flood_chunks(size, lines=lines))


@pytest.mark.parametrize("lines", [False, True], ids=["redraws", "log lines"])
def test_a_flood_reads_the_same_in_any_chunks_and_keeps_every_step(lines, tmp_path):
    data = flood(400_000, lines=lines)
    whole = read(data, [], tmp_path / "whole")
    assert whole[10] == naive_curve(data)
    if not lines:
        assert len(whole[10]) > 100  # the flood moves the bar over many steps, every one of them kept
    rng = random.Random(5)
    for n, largest in enumerate((64, 4096, 65536, 1 << 20)):
        assert read(data, random_cuts(len(data), rng, largest), tmp_path / str(n)) == whole


def test_a_chunk_cut_inside_a_redraw_keeps_the_newest_whole_one_before_it(tmp_path):
    # The cut the issue found: a chunk without \n that ends in a segment that is no bar (here, the next redraw
    # cut short) after its last \r. What came before that \r (the newest whole redraw) must still count.
    data = stream("run1_simple")
    newest = data.index(b"avr_loss=1.07]") + len(b"avr_loss=1.07]")  # step 1's second redraw, with its loss
    start = data.rindex(b"\rsteps:", 0, newest)
    cut = [start, newest + len(b"\rsteps:  6")]  # that redraw, then a few bytes of step 2's first
    assert b"\n" not in data[cut[0]:cut[1]] and not BAR.match(data[data.rindex(b"\r", 0, cut[1]) + 1:cut[1]].decode())
    assert read(data, cut, tmp_path / "cut") == read(data, [], tmp_path / "whole")
    log = JobLog(tmp_path, 2, head_bytes=1 << 20, tail_bytes=1 << 20)
    output = TrainerOutput(log, lambda phase, step: None)
    output.consume(data[:cut[0]], 0.0)
    output.consume(data[cut[0]:cut[1]], 0.0)
    assert (output.progress.step, output.progress.loss) == (1, 1.07)  # at once, not at some later chunk
    assert dict(output.parser.take_points())[1] == 1.07
    log.close()


def test_a_crlf_model_saved_cut_between_its_cr_and_lf_is_not_lost(tmp_path):
    # A logger that ends lines in \r\n, cut between the two: the chunk has no \n and ends in an empty segment
    # after its last \r; `model saved.` came before that \r.
    data = stream("run1_simple").replace(b"model saved.\n", b"model saved.\r\n")
    start = data.index(b"model saved.\r")
    result = read(data, [start, start + len(b"model saved.\r")], tmp_path / "cut")
    assert "model_saved" in result[6] and result == read(data, [], tmp_path / "whole")


def test_an_ansi_escape_cut_between_two_chunks_is_not_left_in_the_log(tmp_path):
    # A rich console with FORCE_COLOR (docs/reference/sd-scripts.md) colours its lines: the real capture's
    # `model saved.` so coloured, the pipe cut inside each escape.
    data = stream("run1_simple").replace(b"model saved.\n", b"\x1b[1mmodel saved.\x1b[0m\n")
    for escape in (b"\x1b[1m", b"\x1b[0m"):
        at = data.index(escape)
        for cut in (at + 1, at + 2):  # after \x1b, after \x1b[
            result = read(data, [cut], tmp_path / f"{cut}")
            assert "\x1b" not in result[11] and "model saved.\n" in result[11] and "model_saved" in result[6]
            assert result == read(data, [], tmp_path / "whole")


def test_an_escape_never_finished_is_kept_as_text_at_the_end(tmp_path):
    result = read(b"caching latents...\n\x1b[12", [20], tmp_path)
    assert result[11].endswith("\x1b[12\n")


# -- the candidates are never fewer than the markers ---------------------------------------------------------

def _paths(items: list) -> list[list[str]]:  # type: ignore[type-arg]
    """Every way through a parsed pattern, as the runs of literals it requires in order. The first run is ''
    where the path begins with anything but a literal; optional parts and classes end a run."""
    paths = [[""]]
    for op, av in items:
        if op is sre_constants.LITERAL:
            for path in paths:
                path[-1] += chr(av)
        elif op in (sre_constants.SUBPATTERN, sre_constants.BRANCH):
            alternatives = av[1] if op is sre_constants.BRANCH else [av[-1]]
            paths = [path[:-1] + [path[-1] + sub[0]] + sub[1:]
                     for path in paths for alternative in alternatives for sub in _paths(list(alternative))]
        else:
            for path in paths:
                path.append("")
    return paths


def test_every_marker_begins_with_a_message_start_or_holds_an_inner_literal():
    # What lets a run of log lines be looked at only where a marker can begin: every way through MARKERS.
    paths = _paths(list(sre_parse.parse(MARKERS.pattern)))
    assert len(paths) >= 25
    for path in paths:
        starts = any(path[0].startswith(start) for start in MESSAGE_STARTS)
        inner = any(literal.decode() in run for run in path for literal in INNER_LITERALS)
        assert starts or inner, path


MARKER_LINES = [
    "caching latents...", "  caching Text Encoder outputs with caching strategy.",
    "\t\tINFO     import network module: networks.lora   train_network.py:312",
    "2026-11-30 03:36:26 INFO     model saved.          train_network.py:1729",
    "  0%|          | 0/3 [00:00<?, ?it/s]caching Text Encoder outputs...",
    "0it [00:00, ?it/s]No data found. Please verify arguments (train_data_dir must be the parent …)",
    "steps: 100%|██| 2/2 [00:19<00:00,  9.87s/it, avr_loss=1.08] WARNING  saving checkpoint: /o/x.safetensors",
    "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name'",
    "OSError: We couldn't connect to 'https://huggingface.co' to load this file",
    "sdxl_train_network.py: error: unrecognized arguments: --bogus",
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.",
    "subprocess.CalledProcessError: Command '['x']' died with <Signals.SIGKILL: 9>.",
]


@pytest.mark.parametrize("line", MARKER_LINES)
def test_a_marker_line_is_a_candidate_and_counts_in_a_run_of_log_lines(line):
    filler = "".join(f"create LoRA for U-Net: {i} modules.\n" for i in range(100))
    for text in (line + "\n" + filler, filler + line + "\n" + filler):  # first in the run, or inside a long one
        data = text.encode()
        starts = message_starts(data, 0, len(data))
        at = data.index(line.encode())
        assert at in starts
        parser, alone = Parser(), Parser()
        parser.feed(b"\n" + data)
        alone.feed(b"\n" + line.encode() + b"\n")
        assert alone.progress.flags or alone.progress.phase.value != "launching"
        assert (parser.progress.phase, parser.progress.flags) == (alone.progress.phase, alone.progress.flags)

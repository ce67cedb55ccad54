"""The parser of sd-scripts' output is total: fed any bytes in any chunks, it never raises, what it says stays sane
(a step within its total, numbers a ledger column holds, a loss that is a float or None), and the same bytes cut
anywhere read the same. The streams are real captures cut up and glued together, sd-scripts' own lines and
redraws with their numbers drawn at random (too many digits, digits of other scripts, `1.2.3it/s`), ANSI escapes,
invalid UTF-8 and any bytes. The budget is the Hypothesis profile's (tests/helpers/fuzz.py)."""
from __future__ import annotations

import math
import re

import pytest
from hypothesis import example, given, strategies as st

from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.explain import explain, quotable
from lora_worker.transcript.markers import MESSAGE_STARTS
from lora_worker.transcript.parser import MAX_PENDING, MAX_SIGNAL, MAX_STATUS, Parser
from lora_worker.transcript.redraws import BAR, MAX_COUNT, count, loss
from tests.helpers.captures import CAPTURES, stream
from tests.helpers.checkpoints import WatchedJob

pytestmark = pytest.mark.fuzz

REAL = {name: stream(name) for name in CAPTURES}
# Mostly a run's numbers; sometimes one past a ledger column, past what int() converts (4300 digits), or no number.
numbers = st.one_of(st.integers(0, 2000).map(str), st.integers(0, 2000).map(str), st.integers(0, 10**30).map(str),
                    st.sampled_from(["", "?", "٣", "1.2.3", ".", "e", "nan", "inf", "-inf", "1e999", "0", "00",
                                     "9" * 400, "9" * 4400]))


@st.composite
def redraws(draw) -> bytes:
    """A redraw of the `steps` bar, its every number drawn from `numbers`."""
    n, total, rate, loss = (draw(numbers) for _ in range(4))
    eta = draw(st.sampled_from(["00:01", "?", "1:02:03", "::", "9" * 400, "1:2:3:4", "99999999999:00"]))
    postfix = draw(st.sampled_from(["", f", avr_loss={loss}", ", avr_loss="]))
    unit = draw(st.sampled_from(["it/s", "s/it"]))
    return f"\rsteps:  45%|████▌     | {n}/{total} [00:01<{eta}, {rate}{unit}{postfix}]".encode()


@st.composite
def log_lines(draw) -> bytes:
    """One of the lines a marker begins, after a logger's prefix or none, with any argument or number."""
    start = draw(st.sampled_from(MESSAGE_STARTS + (
        "total optimization steps / 学習ステップ数: ", "saving state at step ", "Traceback (most recent call last):",
        '  File "x.py", line 1, in f')))
    prefix = draw(st.sampled_from(["", "2026-11-30 03:36:26 INFO     ", "   ", "WARNING "]))
    tail = draw(st.one_of(numbers, st.text(max_size=30),
                          st.sampled_from([" died with <Signals.SIGKILL: 9>.", " returned non-zero exit status 1."])))
    return f"{prefix}{start}{tail}".encode()


@st.composite
def real_slices(draw) -> bytes:
    data = REAL[draw(st.sampled_from(sorted(REAL)))]
    start = draw(st.integers(0, len(data) - 1))
    return data[start:start + draw(st.integers(1, 2000))]


pieces = st.one_of(redraws(), log_lines(), real_slices(),
                   st.sampled_from([b"\r", b"\n", b"\r\n", b"\x1b[1m", b"\x1b["]), st.binary(max_size=40))
streams = st.lists(pieces, max_size=24).map(b"".join)


def feed(data: bytes, cuts: list[int]) -> tuple[Parser, dict[int, float | None]]:
    """`data` fed to a parser in the chunks `cuts` make, then closed; the parser and its loss curve."""
    parser, curve = Parser(), {}
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for a, b in zip(bounds, bounds[1:]):
        parser.feed(data[a:b])
        curve.update(parser.take_points())
    parser.close()
    curve.update(parser.take_points())
    return parser, curve


def assert_sane(parser: Parser, curve: dict[int, float | None]) -> None:
    p = parser.progress
    assert 0 <= p.step <= MAX_COUNT and (p.total_steps is None or 0 <= p.total_steps <= MAX_COUNT)
    assert p.loss is None or isinstance(p.loss, float)
    assert p.rate is None or (math.isfinite(p.rate) and p.rate > 0)
    assert p.eta_s is None or (math.isfinite(p.eta_s) and p.eta_s >= 0)
    assert p.signal is None or 0 <= p.signal <= MAX_SIGNAL
    assert p.inner_exit is None or 0 <= p.inner_exit <= MAX_STATUS
    assert p.nan_at is None or 0 <= p.nan_at <= MAX_COUNT
    assert all(0 < step <= MAX_COUNT for step in curve)
    for save in p.saves:  # what transcript/checkpoints.py makes a row of: a step it can read
        assert save.kind != "state_saved" or 0 <= int(save.text) <= MAX_COUNT


def reading(parser: Parser, curve: dict[int, float | None], *, with_loss: bool = True) -> tuple[object, ...]:
    """What the run makes of the output: everything but how many redraws it took to get there (a chunk of many
    redraws applies each step's newest only), and, of each save, whether a redraw came after it."""
    p = parser.progress
    saves = [(s.kind, s.text, p.redraws > s.redraws) for s in p.saves]
    losses = (nan_aware(p.loss), p.nan_at, {k: nan_aware(v) for k, v in curve.items()}) if with_loss else None
    return (p.phase, p.phases, p.step, p.total_steps, p.rate, p.eta_s, sorted(p.flags), p.signal, p.inner_exit,
            p.checkpoints, saves, losses)


def nan_aware(value: float | None) -> object:
    return "nan" if value is not None and math.isnan(value) else value


def newest_tells_all(data: bytes) -> bool:
    """Whether, as in tqdm's output, the bar's step never goes back and the newest redraw of each step shows what
    the earlier ones of it did: a loss if any showed one, NaN if any showed NaN (tqdm keeps its postfix from one
    redraw to the next). The loss, the first NaN step and the loss curve are read from each step's newest redraw
    (transcript/redraws.py bar_before: a run of redraws is read from the newest back, a step at a time); in text
    shaped like the bar that breaks this, they may depend on the cuts. Everything else never does."""
    bars = [(count(m[1]), loss(m[7])) for segment in re.split(rb"[\r\n]", data)
            if (m := BAR.match(segment.decode("utf-8", "replace")))]
    for (step, value), (after, later) in zip(bars, bars[1:]):
        if step is None or after is None or after < step:
            return False
        if after == step and value is not None and (later is None or (math.isnan(value) and not math.isnan(later))):
            return False
    return True


def same_reading(a: tuple[Parser, dict], b: tuple[Parser, dict], data: bytes) -> None:
    with_loss = newest_tells_all(data)
    assert reading(*a, with_loss=with_loss) == reading(*b, with_loss=with_loss)


@given(streams, st.lists(st.integers(min_value=0), max_size=12))
# the bar going back (1/0, then 0/0): only the loss curve may differ by the cuts (newest_tells_all)
@example(b"\rsteps:  45%|x| 1/0 [00:01<00:01, 0it/s]\rsteps:  45%|x| 0/0 [00:01<00:01, 0it/s]"
         b"\rsteps:  45%|x| 0/0 [00:01<00:01, 0it/s]", [1])
@example(b"steps:  1%|x| 1/2 [00:00<00:00, 1.2.3it/s]\r", [])  # float('1.2.3') raised out of the parser
@example(b"steps:  1%|x| " + b"9" * 5000 + b"/2 [00:00<00:00, 1.2it/s]\r", [])  # int() of 5000 digits raised
@example(b"steps:  1%|x| 1/2 [00:00<" + b"9" * 400 + b", 1.2it/s]\r", [])  # float() of a 400-digit ETA overflowed
# in a run of redraws, the one before a 4400-digit step was looked for with int() of it
@example(b"\rsteps:  1%|x| 1/9 [00:00<00:00, 1.2it/s]\rsteps:  1%|x| " + b"9" * 4400 + b"/9 [00:00<00:00, 1it/s]\rx\n",
         [])
def test_any_output_in_any_chunks_reads_the_same_and_stays_sane(data, cuts):
    whole = feed(data, [])
    assert_sane(*whole)
    cut = feed(data, cuts)
    assert_sane(*cut)
    same_reading(cut, whole, data)


@given(streams)
# a loss shown by one redraw of step 0 and not by the newest: only the loss may differ by the cuts
# a newest redraw whose total is past MAX_COUNT hid the one before it when read in one chunk (make fuzz)
@example(b"\rsteps:  45%|x| 0/0 [00:01<00:01, 0it/s]\rsteps:  45%|x| 0/1000000001 [00:01<00:01, 0it/s]\r")
# the same, between a redraw glued to a marker and that redraw again: it made the last one count again (make fuzz)
@example(b"\rsteps:  45%|x| 0/0 [00:01<00:01, 0it/s]load StableDiffusion checkpoint: "
         b"\rsteps:  45%|x| 0/" + b"9" * 400 + b" [00:01<00:01, 0it/s]\rsteps:  45%|x| 0/0 [00:01<00:01, 0it/s]")
@example(b"\rsteps:  45%|x| 0/0 [00:01<00:01, 0it/s, avr_loss=0]\rsteps:  45%|x| 0/0 [00:01<00:01, 0it/s]\rx")
def test_any_output_a_byte_at_a_time_reads_as_the_whole(data):
    data = data[:2048]  # a byte a time: kept to a second or two
    same_reading(feed(data, list(range(len(data)))), feed(data, []), data)


@given(st.lists(st.text(max_size=60) | log_lines().map(lambda b: b.decode()), max_size=40))
def test_any_tail_of_lines_is_explained_or_not_never_a_crash(lines):
    """explain.py reads the last lines of a failed run, whatever they are."""
    found = explain(lines)
    assert found is None or isinstance(found.line, str)
    assert all(isinstance(line, str) for line in quotable(lines))


@pytest.mark.parametrize("cut", [1, 1024, 65536])
def test_a_line_longer_than_the_parser_holds_reads_the_same_in_any_chunks(cut):
    """A segment past MAX_PENDING keeps its head, wherever the pipe cut it: its marker still counts, as it does
    when the whole line comes in one read."""
    line = b"saving checkpoint: /data/t1/output/" + b"x" * (MAX_PENDING + 10_000) + b".safetensors\n"
    data = b"caching latents...\n" + line + b"model saved.\n"
    whole = feed(data, [])
    assert whole[0].progress.checkpoints
    same_reading(feed(data, list(range(cut, len(data), cut))), whole, data)


@pytest.mark.parametrize("unit", [b"torch.", b"subprocess.CalledProcessError: Command ", b"1%|a|[x]", b" ",
                                  b"ValueError: The provided pretrained_model_name_or_path \""])
def test_a_long_line_of_marker_fragments_is_read_in_one_pass(unit):
    """A marker was searched for along each line and its prefix checked after: a branch's `[\\w.]+` or `[^\\r\\n]*`
    then ran to the line's end from every position, and one 60 KB line of `torch.torch.…` (an exception message
    quoting a caption, say) held the supervisor's loop for 134 s, past this suite's 120 s timeout. Anchored at the
    line's start, ten such lines read as quickly as any; and none of them is a marker."""
    for prefix in (b"", b"ValueError: ", b"2026-11-30 03:36:26 INFO     "):
        line = prefix + unit * (60_000 // len(unit)) + b"\n"
        parser, _ = feed(line * 10, [])
        assert parser.progress.flags == set() and parser.progress.saves == []


step_numbers = st.one_of(st.integers(0, 10**9).map(lambda n: f"{n:08d}"), numbers, st.just("٠٠٠٠٠٠٠٤"))


@given(st.lists(st.tuples(st.sampled_from(["saving checkpoint", "removing old checkpoint", "removing old state"]),
                          step_numbers, st.sampled_from([".safetensors", "-state"])), max_size=6), streams)
@example([("saving checkpoint", "9" * 5000, ".safetensors")], b"")  # int() of it raised in the supervisor's loop
@example([("saving checkpoint", "9" * 20, ".safetensors")], b"")  # a step no INTEGER column holds
def test_the_checkpoints_of_any_save_lines_are_rows_a_ledger_holds(tmp_path_factory, saves, noise):
    """What the parser feeds the supervisor's tick: transcript/checkpoints.py makes rows of its saves, whatever
    the lines say, each with a step a ledger column holds."""
    out = tmp_path_factory.getbasetemp() / "out"
    lines = "".join(f"\n{verb}: {out}/ohwx-step{digits}{suffix}\n" for verb, digits, suffix in saves)
    parser, _ = feed(noise + lines.encode() + b"\rsteps:  1%|x| 1/9 [00:01<00:02, 1it/s]\r", [])
    for row in Checkpoints(WatchedJob(str(out))).take(parser.progress, ended=True):
        assert 0 <= row.step < 2**63  # a SQLite INTEGER


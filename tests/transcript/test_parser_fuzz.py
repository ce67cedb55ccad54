"""The parser of sd-scripts' output is total: fed any bytes in any chunks, it never raises, what it says stays sane
(a step within its total, numbers a ledger column holds, a loss that is a float or None), and the same bytes cut
anywhere read the same. The streams are real captures cut up and glued together, sd-scripts' own lines and
redraws with their numbers drawn at random (too many digits, digits of other scripts, `1.2.3it/s`), ANSI escapes,
invalid UTF-8 and any bytes. The budget is the Hypothesis profile's (tests/helpers/fuzz.py)."""
from __future__ import annotations

import math

import pytest
from hypothesis import example, given, strategies as st

from lora_worker.transcript.explain import explain, quotable
from lora_worker.transcript.markers import MESSAGE_STARTS
from lora_worker.transcript.parser import MAX_PENDING, MAX_SIGNAL, MAX_STATUS, Parser
from lora_worker.transcript.redraws import MAX_COUNT
from tests.helpers.captures import CAPTURES, stream

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


def reading(parser: Parser, curve: dict[int, float | None]) -> tuple[object, ...]:
    """What the run makes of the output: everything but how many redraws it took to get there (a chunk of many
    redraws applies each step's newest only), and, of each save, whether a redraw came after it."""
    p = parser.progress
    loss = "nan" if p.loss is not None and math.isnan(p.loss) else p.loss
    saves = [(s.kind, s.text, p.redraws > s.redraws) for s in p.saves]
    curve_ = {k: "nan" if v is not None and math.isnan(v) else v for k, v in curve.items()}
    return (p.phase, p.phases, p.step, p.total_steps, loss, p.rate, p.eta_s, sorted(p.flags), p.signal, p.nan_at,
            p.inner_exit, p.checkpoints, saves, curve_)


@given(streams, st.lists(st.integers(min_value=0), max_size=12))
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
    assert reading(*cut) == reading(*whole)


@given(streams)
def test_any_output_a_byte_at_a_time_reads_as_the_whole(data):
    data = data[:2048]  # a byte a time: kept to a second or two
    assert reading(*feed(data, list(range(len(data))))) == reading(*feed(data, []))


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
    assert whole[0].progress.checkpoints and reading(*feed(data, list(range(cut, len(data), cut)))) == reading(*whole)


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

"""A saved state's check is total: whatever bytes its files hold, `check_state` answers a StateCheck whose problems
are resume reasons (errors.RESUME_REASONS), never an exception. The inputs are a real state as the fake trainer
writes it (accelerate's files, torch's zip layout: tests/fakes/sd_states.py) with one file changed: bits flipped,
cut short, replaced by any bytes, a zip record's flags or compression method set to anything (issue #38: one
flipped flag bit made zipfile raise RuntimeError past the check), train_state.json replaced by any JSON or nested
past the stack. The budget is the Hypothesis profile's (tests/helpers/fuzz.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import example, given, strategies as st

from lora_worker.errors import RESUME_REASONS
from lora_worker.host.train_state import ARCHIVES, MODEL, TRAIN_STATE, check_state, state_name
from tests.fakes.sd_states import save_state
from tests.helpers.states import LORA_MODULES, set_zip_record_field

pytestmark = pytest.mark.fuzz

RANK, STEP = 4, 4
NAME = state_name("ohwx", STEP)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, bytes]:
    """A real state's files, as the fake trainer saves them at step 4 (checked intact first)."""
    out = tmp_path_factory.mktemp("pristine")
    save_state(lambda _line: None, str(out / NAME), epoch=1, step=STEP, modules=[(m, 64, 64) for m in LORA_MODULES],
               rank=RANK, alpha=1.0, lr=1e-4)
    check = check_state(str(out), NAME, rank=RANK)
    assert check.problems == [] and check.current_step == STEP
    return {p.name: p.read_bytes() for p in (out / NAME).iterdir()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("states")


def checked(workdir: Path, files: dict[str, bytes]) -> list[str]:
    """The state written afresh with these files and checked; the codes of its problems (the property: every
    answer is a StateCheck, and every problem a resume reason)."""
    state = workdir / NAME
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir()
    for name, data in files.items():
        (state / name).write_bytes(data)
    check = check_state(str(workdir), NAME, rank=RANK)
    codes = [p.code for p in check.problems]
    assert set(codes) <= set(RESUME_REASONS), codes
    assert all(p.message.startswith(f"{NAME}: ") for p in check.problems)
    return codes


def flipped(data: bytes, bits: list[int]) -> bytes:
    out = bytearray(data)
    for bit in bits:
        at = bit % (len(out) * 8)
        out[at // 8] ^= 1 << (at % 8)
    return bytes(out)


archives = st.sampled_from(ARCHIVES)
files = st.sampled_from((*ARCHIVES, MODEL, TRAIN_STATE))


@given(files, st.lists(st.integers(min_value=0), min_size=1, max_size=8))
def test_a_state_with_flipped_bits_is_checked(pristine, workdir, name, bits):
    codes = checked(workdir, {**pristine, name: flipped(pristine[name], bits)})
    if name in ARCHIVES and "state_archive_corrupt" not in codes:
        assert codes == [] or codes == ["state_unverifiable"]  # a bit no reader looks at, or a size now too large


@given(archives, st.sampled_from(["central", "local"]), st.sampled_from(["flags", "method"]),
       st.integers(0, 0xFFFF), st.integers(min_value=0))
def test_a_zip_record_with_any_flags_or_method_is_checked(pristine, workdir, name, which, field, value, nth):
    """Issue #38's case: the encrypted flag (bit 0) is RuntimeError in zipfile, an unknown method
    NotImplementedError; each is now the archive's refusal."""
    checked(workdir, {**pristine, name: set_zip_record_field(pristine[name], which, field, value, nth)})


def test_the_encrypted_flag_and_an_unknown_method_are_refused_as_corrupt(pristine, workdir):
    for field, value in (("flags", 0x1), ("method", 99), ("method", 9)):  # 9: deflate64, which zipfile lacks
        changed = set_zip_record_field(pristine["optimizer.bin"], "central", field, value, 0)
        assert checked(workdir, {**pristine, "optimizer.bin": changed}) == ["state_archive_corrupt"], (field, value)


@given(files, st.integers(min_value=0), st.binary(max_size=64))
def test_a_state_file_cut_short_or_extended_is_checked(pristine, workdir, name, keep, tail):
    data = pristine[name]
    checked(workdir, {**pristine, name: data[:keep % (len(data) + 1)] + tail})


@given(files, st.binary(max_size=4096))
def test_a_state_file_of_any_bytes_is_checked(pristine, workdir, name, data):
    codes = checked(workdir, {**pristine, name: data})
    assert codes, "a state file replaced by arbitrary bytes passed the check"


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                     max_size=3), max_leaves=12)


@given(st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"current_epoch": json_values, "current_step": json_values}).map(
        lambda v: json.dumps(v).encode()),
    st.integers(1, 4096).map(lambda n: b"[" * n),  # nested past the stack within the 4 KB the check reads
    st.integers(4097, 10_000).map(lambda n: b" " * n + b"{}"),  # more than it reads
))
@example(b"[" * 4096)  # nested past the stack: RecursionError out of json.loads before issue #38
@example(b'{"current_epoch": 1, "current_step": 4.0}')
def test_any_train_state_json_is_checked(pristine, workdir, data):
    codes = checked(workdir, {**pristine, TRAIN_STATE: data})
    doc = _json_or_none(data)
    good = isinstance(doc, dict) and type(doc.get("current_epoch")) is int and type(doc.get("current_step")) is int \
        and doc["current_step"] == STEP
    assert (codes == []) is good, (data[:80], codes)


def _json_or_none(data: bytes) -> object:
    try:
        return json.loads(data) if len(data) <= 4096 else None
    except (ValueError, RecursionError):
        return None

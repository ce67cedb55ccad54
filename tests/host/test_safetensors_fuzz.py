"""The safetensors header parser is total: whatever bytes a file holds, `parse_header` returns a Header or raises
HeaderError, never anything else, in bounded time and memory; and what it accepts, the real loader opens.
The inputs are arbitrary bytes and mutations of real headers (the run's LoRA, the SDXL checkpoint's, a step LoRA
of the rig's): flipped bits, lying lengths, nested JSON, huge numbers, wrong types. The budget is the Hypothesis
profile's (tests/helpers/fuzz.py: `make test` a few, `make fuzz` thousands)."""
from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path

import pytest
from hypothesis import assume, example, given, strategies as st
from safetensors import safe_open

from lora_worker.host.safetensors import DTYPE_BITS, HeaderError, lora_info, parse_header

pytestmark = pytest.mark.fuzz

DATA = Path(__file__).parent.parent / "data"


def _real_tensors() -> list[tuple[dict, dict | None]]:
    """(tensors, metadata) of the three real files tests/data describes."""
    lora = json.loads((DATA / "lora-header-run1_simple.json").read_text())
    sdxl = json.loads((DATA / "sdxl-checkpoint-header.json").read_text())
    step = json.loads((DATA / "rig" / "step-lora-step4.header.json").read_text())
    return [(lora["tensors"], lora["__metadata__"]), (sdxl["tensors"], None),
            ({k: v for k, v in step.items() if k != "__metadata__"}, step["__metadata__"])]


REAL = _real_tensors()
WINDOW = 32  # tensors of a real header taken together: a mutation is local, and a 280 KB header costs 10 ms a dump


@st.composite
def real_headers(draw) -> tuple[dict, int]:
    """A run of a real header's tensors (their names, dtypes and shapes) with its metadata, laid end to end as the
    file lays them: (the header, its data bytes)."""
    tensors, metadata = REAL[draw(st.integers(0, len(REAL) - 1))]
    names = list(tensors)
    start = draw(st.integers(0, len(names) - 1))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names[start:start + WINDOW]:
        info = tensors[name]
        size = DTYPE_BITS[info["dtype"]] * math.prod(info["shape"]) // 8
        header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


class SparseFile(io.RawIOBase):
    """A file of `size` bytes whose first ones are `head` and the rest zeros, never held in memory: a 6.9 GB
    checkpoint's header is parsed as the real file's would be."""

    def __init__(self, head: bytes, size: int) -> None:
        self.head, self.size, self.pos = head, size, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self.pos + n)
        data = self.head[self.pos:end] + b"\0" * max(0, end - max(self.pos, len(self.head)))
        self.pos = end
        return data


def file_of(raw: bytes, data_bytes: int, *, length: int | None = None) -> SparseFile:
    head = struct.pack("<Q", len(raw) if length is None else length) + raw
    return SparseFile(head, len(head) + data_bytes)


def parses_or_refuses(fh) -> object:
    """The property: a Header, or HeaderError (anything else fails the test, with its traceback)."""
    try:
        return parse_header(fh, "m.safetensors")
    except HeaderError as exc:
        assert str(exc).startswith("m.safetensors: ") and len(str(exc)) < 2000  # a reason, said briefly
        return exc


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.integers(min_value=2**63, max_value=2**70),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@given(st.binary(max_size=4096))
def test_any_bytes_are_a_header_or_its_refusal(data):
    parses_or_refuses(SparseFile(data, len(data)))


@given(st.binary(max_size=2048), st.integers(min_value=0, max_value=2**64 - 1), st.integers(0, 1 << 40))
def test_any_header_bytes_with_any_length_are_a_header_or_its_refusal(raw, length, data_bytes):
    """A length that lies (up to 2**64 - 1) is refused before anything is read: nothing is allocated for it."""
    parses_or_refuses(file_of(raw, data_bytes, length=length))


@given(st.sampled_from([b"[", b'{"a":', b'{"a":{"shape":']), st.integers(1, 200_000))
@example(b"[", 100_000)
@example(b'{"a":{"shape":', 10_000)
def test_a_header_nested_past_the_stack_is_refused(opening, depth):
    """Issue #38: a deeply nested header made json.loads raise RecursionError out of the parser."""
    raw = opening * depth
    result = parses_or_refuses(file_of(raw, 0))
    assert isinstance(result, HeaderError)


@given(real_headers(), st.data())
def test_a_real_header_with_one_entry_replaced_is_a_header_or_its_refusal(real, data):
    header, data_bytes = real
    assert not isinstance(parses_or_refuses(file_of(json.dumps(header).encode(), data_bytes)), HeaderError)
    name = data.draw(st.sampled_from(sorted(header)))
    field = data.draw(st.sampled_from([None, "dtype", "shape", "data_offsets"]))
    value = data.draw(json_values)
    changed = {**header, name: value if field is None or not isinstance(header[name], dict)
               else {**header[name], field: value}}
    result = parses_or_refuses(file_of(json.dumps(changed).encode(), data_bytes))
    if not isinstance(result, HeaderError):
        _lora_info_or_refusal(result)


@given(real_headers(), st.lists(st.integers(min_value=0), min_size=1, max_size=8), st.integers(-64, 64))
def test_a_real_header_with_flipped_bits_and_a_changed_size_is_a_header_or_its_refusal(real, flips, size_change):
    header, data_bytes = real
    head = bytearray(struct.pack("<Q", 0) + json.dumps(header).encode())
    struct.pack_into("<Q", head, 0, len(head) - 8)
    for flip in flips:  # a flipped bit anywhere: in the length, a name, a number, a bracket
        bit = flip % (len(head) * 8)
        head[bit // 8] ^= 1 << (bit % 8)
    result = parses_or_refuses(SparseFile(bytes(head), max(0, len(head) + data_bytes + size_change)))
    if not isinstance(result, HeaderError):
        _lora_info_or_refusal(result)


def _lora_info_or_refusal(header) -> None:
    try:
        lora_info(header, "m.safetensors")
    except HeaderError:
        pass


@st.composite
def small_files(draw) -> tuple[bytes, int]:
    """A small header, well formed or nearly: tensors of any dtype and small shapes, laid end to end, in any
    order, then maybe one offset or dimension moved, a metadata entry of any JSON, or bytes left over."""
    names = draw(st.lists(st.text(min_size=1, max_size=6), max_size=5, unique=True))
    header: dict = {}
    offset = 0
    for name in draw(st.permutations(names)):
        dtype = draw(st.sampled_from(sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = DTYPE_BITS[dtype] * math.prod(shape) // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if names and draw(st.booleans()):
        entry = header[draw(st.sampled_from(names))]
        key = draw(st.sampled_from(["shape", "data_offsets"]))
        if entry[key]:
            i = draw(st.integers(0, len(entry[key]) - 1))
            entry[key][i] = draw(st.integers(-2, 2**64 + 2))
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5))
                                      | json_values)
    raw = json.dumps(header).encode()
    return raw + b" " * draw(st.integers(0, 8)), offset + draw(st.sampled_from([0, 0, 0, 1, -1]))


@given(small_files())
def test_what_the_parser_accepts_the_real_loader_opens(tmp_path_factory_dir, file):
    """Sound against safetensors.safe_open: a header accepted here is one the trainer's loader opens."""
    raw, data_bytes = file
    assume(data_bytes >= 0)
    fh = file_of(raw, data_bytes)
    result = parses_or_refuses(fh)
    if isinstance(result, HeaderError):
        return
    path = tmp_path_factory_dir / "m.safetensors"
    fh.seek(0)
    path.write_bytes(fh.read(fh.size))
    with safe_open(str(path), framework="numpy") as opened:
        assert set(opened.keys()) == set(result.tensors)


@pytest.fixture(scope="module")
def tmp_path_factory_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("safetensors")

"""The safetensors header, parsed and checked without torch: what a file from the train root says its tensors are.

Format: 8 bytes little-endian header length N, then N bytes of JSON (`{name: {dtype, shape, data_offsets}}`
plus an optional `__metadata__` of strings), then the tensor bytes, fully indexed with no holes. The header is
checked as the reference loader checks it (offsets, sizes, coverage: see `_check_offsets`), so what passes here
is what `safetensors.safe_open` opens; tests/host/test_safetensors.py holds the two together.

The bytes are anyone's: `parse_header` returns a Header or raises HeaderError, for every input
(tests/host/test_safetensors_fuzz.py), in time and memory bounded by the file's size and MAX_HEADER_BYTES.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors reference implementation enforces
MAX_INDEX = 1 << 64  # its offsets and dimensions are `usize`: a larger number is refused, never multiplied out


class HeaderError(ValueError):
    """The file is not a complete, well-formed safetensors file."""


@dataclass(frozen=True)
class Header:
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    file_size: int


def parse_header(fh: BinaryIO, name: str) -> Header:
    """The header of the open file `fh` (`name` is how errors call it)."""
    fh.seek(0, 2)
    size = fh.tell()
    fh.seek(0)
    prefix = fh.read(8)
    if len(prefix) < 8:
        raise HeaderError(f"{name}: shorter than 8 bytes")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or length > size - 8:
        raise HeaderError(f"{name}: header length {length} does not fit a {size}-byte file")
    raw = fh.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: not UTF-8, not JSON, or an integer of more digits than Python converts (4300); RecursionError:
        # arrays or objects nested deeper than the interpreter's stack (a 2-byte `[[` per level is enough)
        raise HeaderError(f"{name}: header is not JSON ({type(exc).__name__}: {shorten(str(exc))})") from exc
    if not isinstance(header, dict):
        raise HeaderError(f"{name}: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:  # `null` as the reference loader reads it: none; `[]`, `""` or `0` is refused there
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError(f"{name}: __metadata__ must map names to strings")
    _check_offsets(name, header, size - 8 - length)
    return Header(tensors=header, metadata=metadata, file_size=size)


# Bits per element of every dtype the safetensors format names (the reference loader's `Dtype::bitsize`).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64,
              "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _check_offsets(name: str, tensors: dict[str, Any], data_bytes: int) -> None:
    """What the reference loader checks before it opens anything (`Metadata::validate`): taken in the order of
    their offsets, each tensor starts where the one before ended (the first at 0), holds exactly dtype size ×
    product(shape) bytes, and the last ends at the end of the file: no gap, no overlap, nothing left over.
    A header with the right names and shapes but offsets of `[0, 0]` is refused here, not by the trainer."""
    spans = sorted((_span(name, tensor, info) + (tensor,) for tensor, info in tensors.items()))
    end = 0
    for begin, stop, size, tensor in spans:
        if begin != end:
            raise HeaderError(f"{name}: tensor {quoted(tensor)} starts at {begin}, not at {end} "
                              f"(the data region has a {'gap' if begin > end else 'overlap'})")
        if stop - begin != size:
            raise HeaderError(f"{name}: tensor {quoted(tensor)} spans {stop - begin} bytes; its dtype and shape "
                              f"take {size}")
        end = stop
    if end != data_bytes:
        raise HeaderError(f"{name}: {data_bytes} data bytes but tensors index {end} (truncated or padded)")


def _span(name: str, tensor: str, info: Any) -> tuple[int, int, int]:
    """A tensor's (begin, stop, bytes its dtype and shape take), or HeaderError for a malformed entry."""
    try:
        begin, stop = info["data_offsets"]
        shape, dtype = info["shape"], info["dtype"]
    except (KeyError, TypeError, ValueError) as exc:
        raise HeaderError(f"{name}: tensor {quoted(tensor)} has a malformed entry") from exc
    if not _naturals(shape):
        raise HeaderError(f"{name}: tensor {quoted(tensor)} has a malformed shape")
    if not (isinstance(dtype, str) and dtype in DTYPE_BITS):
        raise HeaderError(f"{name}: tensor {quoted(tensor)} has an unknown dtype {quoted(dtype)}")
    if not _naturals([begin, stop]) or stop < begin:
        raise HeaderError(f"{name}: tensor {quoted(tensor)} has malformed data_offsets")
    bits = DTYPE_BITS[dtype]
    for dimension in shape:  # the reference loader's checked multiplication: no product past 64 bits
        bits *= dimension
        if bits >= MAX_INDEX * 8:
            raise HeaderError(f"{name}: tensor {quoted(tensor)} has a shape of more than 2**64 bytes")
    if bits % 8:
        raise HeaderError(f"{name}: tensor {quoted(tensor)} does not fill whole bytes")
    return begin, stop, bits // 8


def _naturals(values: Any) -> bool:
    """A JSON list of integers ≥ 0 that fit 64 bits, as the reference loader's `usize` (not floats, not booleans)."""
    return isinstance(values, list) and all(type(v) is int and 0 <= v < MAX_INDEX for v in values)


def shorten(text: str, limit: int = 200) -> str:
    """Text from a hostile header, cut to a length a message can hold."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def quoted(value: Any) -> str:
    """A name or value of a hostile header, quoted as repr() quotes it, cut short."""
    return shorten(repr(value))

"""The proof of success: the LoRA's header is read (never its tensors) and held to what was asked for."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from lora_worker.host.safetensors import (ExpectedLora, HeaderError, inspect_lora, read_header, sha256_of,
                                          verify_lora)
from tests.helpers import write_safetensors

REAL = json.loads((Path(__file__).parent.parent / "data" / "lora-header-run1_simple.json").read_text())
ASKED = ExpectedLora(rank=4, output_name="ohwx", steps=3, seed=42, dtype="F32")  # what run1_simple asked for


def real_lora(path: Path, *, metadata: dict[str, str] | None = None, rank: int | None = None,
              keep=lambda name: True, truncate_by: int = 0, dtype=lambda name: None) -> Path:
    """The real run's LoRA (its 2166 tensor names and shapes), zero data, with changes."""
    tensors = {}
    for name, info in REAL["tensors"].items():
        if not keep(name):
            continue
        shape = list(info["shape"])
        if rank is not None and name.endswith(".lora_down.weight"):
            shape[0] = rank
        tensors[name] = (dtype(name) or info["dtype"], shape)
    write_safetensors(path, tensors, {**REAL["__metadata__"], **(metadata or {})}, truncate_by=truncate_by)
    return path


def test_the_real_runs_lora_is_verified(tmp_path):
    check = verify_lora(real_lora(tmp_path / "ohwx.safetensors"), ASKED)
    assert check.problem is None and check.size == (tmp_path / "ohwx.safetensors").stat().st_size
    assert check.metadata["ss_network_dim"] == "4"


@pytest.mark.parametrize("change, problem", [
    ({"rank": 8}, "rank [8] instead of 4"),
    ({"metadata": {"ss_network_dim": "8"}}, "ss_network_dim '8' instead of 4"),
    ({"metadata": {"ss_output_name": "other"}}, "ss_output_name 'other' instead of 'ohwx'"),
    ({"metadata": {"ss_max_train_steps": "1500"}}, "ss_max_train_steps '1500' instead of 3"),
    ({"metadata": {"ss_seed": "7"}}, "ss_seed '7' instead of 42"),
    ({"keep": lambda name: not name.startswith("lora_unet")}, "no lora_down weights"),
    ({"dtype": lambda name: "F16" if name.endswith(".weight") else None}, "tensors of another dtype than F32 (1444 F16)"),
    # one module saved in another precision is enough to refuse the file
    ({"dtype": lambda name: "BF16" if name.endswith("proj_in.lora_up.weight") else None},
     "dtype ['BF16', 'F32'] instead of 'F32'"),
])
def test_a_lora_that_is_not_the_one_asked_for_is_refused(tmp_path, change, problem):
    path = real_lora(tmp_path / "ohwx.safetensors", **change)
    check = verify_lora(path, ASKED)
    assert check.problem is not None and problem in check.problem, check


def test_the_dtype_check_counts_the_alphas_too(tmp_path):
    # sd-scripts casts every tensor it saves (down, up and the alpha scalars) to --save_precision, so a file
    # whose alphas alone differ was not written by the run that was asked for.
    check = verify_lora(real_lora(tmp_path / "ohwx.safetensors",
                                  dtype=lambda name: "F16" if name.endswith(".alpha") else None), ASKED)
    assert check.mismatch and "F16" in check.problem, check
    dtypes = inspect_lora(tmp_path / "ohwx.safetensors").dtypes
    assert set(dtypes) == {"F32", "F16"} and dtypes["F16"] == dtypes["F32"] // 2


def test_a_truncated_file_is_invalid_not_a_mismatch(tmp_path):
    check = verify_lora(real_lora(tmp_path / "ohwx.safetensors", truncate_by=1000), ASKED)
    assert "lies outside the file" in check.problem and not check.mismatch and not check.missing


def test_a_missing_or_older_file_is_missing(tmp_path):
    assert verify_lora(tmp_path / "ohwx.safetensors", ASKED).missing
    path = real_lora(tmp_path / "ohwx.safetensors")
    older = verify_lora(path, ASKED, not_before=path.stat().st_mtime + 60)
    assert older.missing and "predates" in older.problem


def raw_safetensors(path: Path, header: dict, data: bytes = b"\0" * 8) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [4, 2], "data_offsets": ["0", "8"]},  # offsets that are not integers
    {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 8.0]},
    {"dtype": "F32", "shape": [4, 2], "data_offsets": [True, 8]},
    {"dtype": "F32", "shape": "4x2", "data_offsets": [0, 8]},
    {"dtype": "F32", "data_offsets": [0, 8]},
    [0, 8],
])
def test_a_malformed_header_is_a_header_error_never_a_crash(tmp_path, entry):
    path = raw_safetensors(tmp_path / "x.safetensors", {"lora_unet_a.lora_down.weight": entry})
    with pytest.raises(HeaderError):
        read_header(path)
    assert verify_lora(path, ASKED).problem is not None


def test_a_lora_down_weight_without_a_shape_is_a_header_error(tmp_path):
    path = raw_safetensors(tmp_path / "x.safetensors",
                           {"lora_unet_a.lora_down.weight": {"dtype": "F32", "shape": [], "data_offsets": [0, 8]}})
    with pytest.raises(HeaderError):
        inspect_lora(path)
    assert "has no shape" in verify_lora(path, ASKED).problem


def test_a_link_where_the_lora_should_be_is_refused_not_followed(tmp_path):
    target = real_lora(tmp_path / "elsewhere.safetensors")
    (tmp_path / "ohwx.safetensors").symlink_to(target)
    check = verify_lora(tmp_path / "ohwx.safetensors", ASKED)
    assert check.problem is not None and "symbolic link" in check.problem and not check.missing
    with pytest.raises(OSError):
        sha256_of(tmp_path / "ohwx.safetensors")


def test_a_fifo_where_the_lora_should_be_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "ohwx.safetensors")  # a plain open() would wait for a writer forever
    check = verify_lora(tmp_path / "ohwx.safetensors", ASKED)
    assert check.problem is not None and "not a regular file" in check.problem
    with pytest.raises(OSError):
        read_header(tmp_path / "ohwx.safetensors")

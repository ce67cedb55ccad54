"""The header check agrees with the real safetensors loader: the same crafted files are fed to
`safetensors.safe_open` and to `read_header`, and both accept or both refuse. And every fake SDXL checkpoint
the demo and the tests write is one the real loader opens, written sparse."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

from lora_worker.dispatch.model import check_base_model
from lora_worker.errors import BaseModelInvalid
from lora_worker.host.safetensors import HeaderError, read_header
from lora_worker.ops.simulated import sdxl_checkpoint_tensors, write_base_model
from tests.helpers import SDXL_TINY, job_rows, write_safetensors


def crafted(path: Path, tensors: dict, data_bytes: int, *, metadata: dict | None = None) -> Path:
    header = {**({"__metadata__": metadata} if metadata is not None else {}), **tensors}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return path


def t(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# name: (tensors, data bytes after the header, the real loader's verdict)
CASES = {
    "well formed": ({"a": t("F16", [2, 2], 0, 8), "b": t("F32", [3], 8, 20)}, 20, True),
    "listed out of offset order": ({"b": t("F32", [3], 8, 20), "a": t("F16", [2, 2], 0, 8)}, 20, True),
    "an empty tensor": ({"a": t("F16", [0, 4], 0, 0), "b": t("F16", [2], 0, 4)}, 4, True),
    "no tensors": ({}, 0, True),
    "every sub-byte and wide dtype": ({"a": t("F4", [4], 0, 2), "b": t("C64", [1], 2, 10), "c": t("BOOL", [2], 10, 12)},
                                      12, True),
    "all offsets [0, 0]": ({"a": t("F16", [2, 2], 0, 0), "b": t("F32", [3], 0, 0)}, 0, False),
    "a length that is not dtype x shape": ({"a": t("F16", [2, 2], 0, 6)}, 6, False),
    "a gap between tensors": ({"a": t("F16", [2], 0, 4), "b": t("F16", [2], 6, 10)}, 10, False),
    "overlapping tensors": ({"a": t("F16", [4], 0, 8), "b": t("F16", [2], 4, 8)}, 8, False),
    "not starting at 0": ({"a": t("F16", [2], 2, 6)}, 6, False),
    "bytes left over at the end": ({"a": t("F16", [2], 0, 4)}, 6, False),
    "data missing at the end": ({"a": t("F16", [4], 0, 8)}, 6, False),
    "end before begin": ({"a": t("F16", [0], 4, 0), "b": t("F16", [2], 0, 4)}, 4, False),
    "an unknown dtype": ({"a": t("F12", [2], 0, 4)}, 4, False),
    "a negative dimension": ({"a": t("F16", [-2], 0, 4)}, 4, False),
    "a sub-byte tensor of odd bits": ({"a": t("F4", [3], 0, 2)}, 2, False),
    "a float offset": ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4.0]}}, 4, False),
}


def real_loader_opens(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy") as fh:
            list(fh.keys())
    except Exception:  # noqa: BLE001 - SafetensorError, or whatever else the loader refuses with
        return False
    return True


def ours_accepts(path: Path) -> bool:
    try:
        read_header(path)
    except HeaderError:
        return False
    return True


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_header_check_agrees_with_the_real_loader(tmp_path, case):
    tensors, data_bytes, verdict = CASES[case]
    path = crafted(tmp_path / "m.safetensors", tensors, data_bytes)
    assert real_loader_opens(path) is verdict  # the case says what the loader does
    assert ours_accepts(path) is verdict


def test_an_sdxl_header_with_all_offsets_zero_is_a_422_before_launch(api, host, launches):
    tensors = {name: t(dtype, shape, 0, 0) for name, (dtype, shape) in sdxl_checkpoint_tensors().items()}
    crafted(host.model, tensors, 0)
    assert not real_loader_opens(host.model)
    response = api.post("/train", json=host.payload())
    body = response.get_json()
    assert response.status_code == 422 and body["error"] == "base_model_invalid", body
    assert "spans 0 bytes" in body["fields"]["base_model_path"][0]
    assert job_rows(host.settings) == 0 and launches == []


def assert_opens_and_sparse(path: Path) -> None:
    assert real_loader_opens(path)
    with safe_open(str(path), framework="numpy") as fh:
        assert len(list(fh.keys())) == len(SDXL_TINY)
    check_base_model(path)  # and the preflight accepts it
    st = path.stat()
    assert st.st_size > 6_900_000_000 and st.st_blocks * 512 < 16 << 20  # 6.9 GB that costs no disk


def test_the_simulated_checkpoint_is_one_the_real_loader_opens(tmp_path):
    assert_opens_and_sparse(write_base_model(tmp_path / "sdxl_base_simulated.safetensors"))


def test_the_test_helpers_checkpoint_is_one_the_real_loader_opens(tmp_path, host):
    write_safetensors(tmp_path / "m.safetensors", SDXL_TINY)
    assert_opens_and_sparse(tmp_path / "m.safetensors")
    assert_opens_and_sparse(host.model)  # what every test's host fixture serves


def test_a_refusal_names_the_tensor(tmp_path):
    crafted(tmp_path / "m.safetensors", {"a": t("F16", [2, 2], 0, 6)}, 6)
    with pytest.raises(BaseModelInvalid, match="'a' spans 6 bytes; its dtype and shape take 8"):
        check_base_model(tmp_path / "m.safetensors")

"""The base-model preflight refuses, from the header, every checkpoint sd-scripts' SDXL loader would die on."""
from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from lora_worker.dispatch.model import FAMILIES, OPTIONAL, check_base_model, expected_shapes, key_set_problem
from lora_worker.errors import BaseModelInvalid
from tests.helpers import DATA, DTYPE_BYTES, SDXL_TINY, job_rows, sdxl_checkpoint_tensors, write_safetensors

SHAPES = {name: shape for name, (_, shape) in SDXL_TINY.items()}
REQUIRED = len(SHAPES) - len(OPTIONAL & SHAPES.keys())


def refusal(tmp_path: Path, tensors: dict[str, tuple[str, list[int]]]) -> BaseModelInvalid:
    model = tmp_path / "m.safetensors"
    write_safetensors(model, tensors)
    with pytest.raises(BaseModelInvalid) as caught:
        check_base_model(model)
    return caught.value


def without(*keys: str) -> dict[str, tuple[str, list[int]]]:
    return {k: v for k, v in SDXL_TINY.items() if k not in keys}


def test_the_shipped_key_set_is_the_real_checkpoints_every_tensor_and_shape():
    real = json.loads((DATA / "sdxl-checkpoint-header.json").read_text())
    assert real["tensor_count"] == 2514 == len(expected_shapes())
    assert expected_shapes() == {name: tuple(info["shape"]) for name, info in real["tensors"].items()}


def test_the_real_checkpoints_key_set_is_accepted(tmp_path):
    model = tmp_path / "sdxl.safetensors"
    write_safetensors(model, SDXL_TINY)
    check_base_model(model)


@pytest.mark.parametrize("family, prefix", FAMILIES)
def test_one_missing_tensor_of_any_family_is_refused_naming_it_and_the_count(tmp_path, family, prefix):
    victim = sorted(k for k in SHAPES if k.startswith(prefix) and k not in OPTIONAL)[-1]
    exc = refusal(tmp_path, without(victim))
    assert exc.details["first_missing_key"] == victim and exc.details["missing_count"] == 1
    message = exc.fields["base_model_path"][0]
    assert repr(victim) in message and f"1 of the {REQUIRED}" in message and family in message


def test_the_real_runs_one_key_per_family_model_is_refused_before_the_trainer_sees_it(tmp_path):
    # fail_model_missing_keys.log: "a valid .safetensors holding one key of each SDXL family, nothing else"
    keep = [sorted(k for k in SHAPES if k.startswith(prefix))[0] for _, prefix in FAMILIES]
    exc = refusal(tmp_path, {k: SDXL_TINY[k] for k in keep})
    assert exc.details["missing_count"] == REQUIRED - len(keep)
    # the loader reads the U-Net first, so that is where the trainer died; the first missing key is a U-Net key
    assert exc.details["first_missing_key"].startswith("model.diffusion_model.")
    assert "VAE" in exc.fields["base_model_path"][0] and "text encoder 2" in exc.fields["base_model_path"][0]


def test_a_wrong_shape_is_refused_naming_the_key_and_both_shapes(tmp_path):
    key = "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight"
    exc = refusal(tmp_path, {**SDXL_TINY, key: ("F16", [49407, 768])})
    assert {k: exc.details[k] for k in ("key", "shape", "expected_shape")} == {
        "key": key, "shape": [49407, 768], "expected_shape": [49408, 768]}
    assert key in exc.message and "[49407, 768]" in exc.message and "[49408, 768]" in exc.message


def test_keys_the_loader_drops_may_be_there_or_not(tmp_path):
    assert key_set_problem({**SHAPES, "conditioner.embedders.0.transformer.text_model.embeddings.position_ids":
                            [1, 77]}) is None
    assert key_set_problem({k: v for k, v in SHAPES.items() if k != "conditioner.embedders.1.model.logit_scale"}) \
        is None


def test_vae_attention_weights_load_as_linear_or_as_1x1_conv_and_nothing_else():
    key = "first_stage_model.encoder.mid.attn_1.q.weight"
    assert key_set_problem({**SHAPES, key: [512, 512]}) is None
    assert key_set_problem({**SHAPES, key: [512, 512, 3, 3]}) is not None
    assert key_set_problem({**SHAPES, "first_stage_model.encoder.conv_in.weight": [128, 3, 3]}) is not None


def test_an_extra_tensor_in_a_strictly_loaded_model_is_refused_and_elsewhere_ignored():
    extra_unet = key_set_problem({**SHAPES, "model.diffusion_model.extra.weight": [4]})
    assert extra_unet is not None and extra_unet.details["first_unexpected_key"] == "model.diffusion_model.extra.weight"
    # what the loader never looks at (a denoiser's sigmas, an EMA copy) does not matter to it
    assert key_set_problem({**SHAPES, "denoiser.sigmas": [1000], "first_stage_model.extra": [1]}) is None


def test_the_preflight_reads_the_header_of_a_real_sized_checkpoint_and_nothing_more(tmp_path):
    """6.9 GB as the real checkpoint (sparse: the data is never written, and must never be read)."""
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in sdxl_checkpoint_tensors().items():
        size = DTYPE_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    model = tmp_path / "sdxl_real_size.safetensors"
    with model.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    assert model.stat().st_size > 6_900_000_000
    expected_shapes()
    before = _bytes_read()
    started = time.perf_counter()
    check_base_model(model)
    elapsed = time.perf_counter() - started
    assert _bytes_read() - before < 2 * len(raw)
    assert elapsed < 1.0  # milliseconds in practice (docs: ~3 ms); a second would mean it read the data


def test_an_incomplete_model_is_a_422_that_changes_nothing(api, host, launches):
    write_safetensors(host.model, without("first_stage_model.decoder.conv_out.bias"))
    response = api.post("/train", json=host.payload())
    body = response.get_json()
    assert response.status_code == 422 and body["error"] == "base_model_invalid"
    assert body["details"]["first_missing_key"] == "first_stage_model.decoder.conv_out.bias"
    assert body["details"]["missing_count"] == 1
    assert "first_stage_model.decoder.conv_out.bias" in body["fields"]["base_model_path"][0]
    assert job_rows(host.settings) == 0 and launches == []


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")

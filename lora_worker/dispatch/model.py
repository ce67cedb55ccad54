"""The base model: a single-file SDXL checkpoint that sd-scripts' loader will accept, judged from its header.

sd-scripts (`library/sdxl_model_util.py::load_models_from_sdxl_checkpoint`) splits the checkpoint by key prefix
into the U-Net, text encoder 1 (CLIP-L), text encoder 2 (OpenCLIP bigG) and the VAE, and loads each with
`_load_state_dict_on_device`, which raises `RuntimeError: Error(s) in loading state_dict … Missing key(s)` for
any key the model has and the file lacks, and `Unexpected key(s)` for one the model lacks. A wrong shape fails
in `set_module_tensor_to_device`. Each of these surfaces only after the trainer has started, imported torch and
read gigabytes; this check refuses them from the header, in milliseconds.

The expected key set (`sdxl_keys.json.gz`, next to this file) is the full tensor list, with shapes, of the real
SDXL checkpoint the sd-scripts captures loaded ("U-Net / text encoder 1 / text encoder 2 / VAE: <All keys
matched successfully>"): all 2514 tensors of tests/data/sdxl-checkpoint-header.json (where it came from:
docs/reference/sd-scripts.md, "The SDXL checkpoint's key set"). It was derived with

    shapes = {k: v["shape"] for k, v in sorted(json.load(open(FIXTURE))["tensors"].items())}
    gzip.compress(json.dumps({"source": …, "tensor_count": 2514, "shapes": shapes},
                             separators=(",", ":")).encode(), 9, mtime=0)

and tests/dispatch/test_model.py holds it to that file, key by key. Two of the loader's own allowances are
applied on top (see OPTIONAL and RESHAPED).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from lora_worker.errors import BaseModelInvalid
from lora_worker.host.safetensors import HeaderError, read_header

# In the order the loader reads them, so "the first missing key" is the one the trainer would die on first.
FAMILIES = (
    ("U-Net", "model.diffusion_model."),
    ("text encoder 1 (CLIP-L)", "conditioner.embedders.0.transformer."),
    ("text encoder 2 (OpenCLIP bigG)", "conditioner.embedders.1.model."),
    ("VAE", "first_stage_model."),
)
# Keys the loader drops before matching: logit_scale is only kept for saving (`checkpoint.get(…, None)`), and
# position_ids is removed because current transformers refuses it. A file may have them or not.
OPTIONAL = frozenset({
    "conditioner.embedders.1.model.logit_scale",
    "conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
    "conditioner.embedders.1.model.text_model.embeddings.position_ids",
})
# The VAE's mid-block attention weights are 1x1 convolutions in the LDM layout; the VAE conversion
# (`conv_attn_to_linear`) takes a 4-D weight's [:, :, 0, 0] and a 2-D one as it is, so both load.
RESHAPED_SUFFIXES = tuple(f"mid.attn_1.{name}.weight" for name in ("q", "k", "v", "proj_out"))
# The VAE conversion picks the keys it knows and ignores the rest; the other three are matched exactly.
STRICT_FAMILIES = frozenset({"U-Net", "text encoder 1 (CLIP-L)", "text encoder 2 (OpenCLIP bigG)"})


@dataclass(frozen=True)
class KeySetProblem:
    """What is wrong with a checkpoint's tensors, worded for the client; `details` for the error body."""

    message: str
    details: dict[str, Any]


@cache
def expected_shapes() -> dict[str, tuple[int, ...]]:
    raw = resources.files("lora_worker.dispatch").joinpath("sdxl_keys.json.gz").read_bytes()
    doc = json.loads(gzip.decompress(raw))
    return {key: tuple(shape) for key, shape in doc["shapes"].items()}


@cache
def expected_in_load_order() -> tuple[str, ...]:
    rank = {name: i for i, (name, _) in enumerate(FAMILIES)}
    return tuple(sorted(expected_shapes(), key=lambda k: (rank.get(family_of(k) or "", len(FAMILIES)), k)))


def family_of(key: str) -> str | None:
    return next((name for name, prefix in FAMILIES if key.startswith(prefix)), None)


def check_base_model(path: Path) -> None:
    """BaseModelInvalid unless the header parses and holds every tensor sd-scripts loads, with its shape."""
    try:
        header = read_header(path)
    except (OSError, HeaderError) as exc:
        raise BaseModelInvalid({"base_model_path": [f"Not a readable safetensors file: {exc}"]}) from exc
    problem = key_set_problem({name: info["shape"] for name, info in header.tensors.items()})
    if problem is not None:
        raise BaseModelInvalid({"base_model_path": [problem.message]}, **problem.details)


def key_set_problem(shapes: dict[str, list[int]]) -> KeySetProblem | None:
    """The first reason sd-scripts' loader would refuse a checkpoint with these tensors, or None."""
    return _missing(shapes) or _misshapen(shapes) or _unexpected(shapes)


def _missing(shapes: dict[str, list[int]]) -> KeySetProblem | None:
    missing = [key for key in expected_in_load_order() if key not in shapes and key not in OPTIONAL]
    if not missing:
        return None
    expected = len(expected_shapes()) - len(OPTIONAL & expected_shapes().keys())
    per_family = {name: sum(family_of(key) == name for key in missing) for name, _ in FAMILIES}
    counts = ", ".join(f"{name} {count}" for name, count in per_family.items() if count)
    return KeySetProblem(
        f"Not a complete SDXL checkpoint: {len(missing)} of the {expected} tensors sd-scripts loads are missing "
        f"({counts}); the first is {missing[0]!r}.",
        {"first_missing_key": missing[0], "missing_count": len(missing), "expected_count": expected})


def _misshapen(shapes: dict[str, list[int]]) -> KeySetProblem | None:
    for key in expected_in_load_order():
        want, have = expected_shapes()[key], shapes.get(key)
        if have is None or tuple(have) == want or _reshapable(key, want, tuple(have)):
            continue
        return KeySetProblem(
            f"Tensor {key!r} ({family_of(key)}) has shape {list(have)}; sd-scripts' SDXL model needs {list(want)}.",
            {"key": key, "shape": list(have), "expected_shape": list(want)})
    return None


def _unexpected(shapes: dict[str, list[int]]) -> KeySetProblem | None:
    known = expected_shapes()
    extra = [key for key in sorted(shapes) if key not in known and key not in OPTIONAL
             and family_of(key) in STRICT_FAMILIES]
    if not extra:
        return None
    return KeySetProblem(
        f"Not an SDXL base checkpoint: {len(extra)} tensor(s) that sd-scripts' {family_of(extra[0])} does not "
        f"have, e.g. {extra[0]!r} (its loader refuses unexpected keys).",
        {"first_unexpected_key": extra[0], "unexpected_count": len(extra)})


def _reshapable(key: str, want: tuple[int, ...], have: tuple[int, ...]) -> bool:
    return key.endswith(RESHAPED_SUFFIXES) and family_of(key) == "VAE" and have == want[:2]


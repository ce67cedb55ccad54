"""The resolve step: a raw request becomes a resolved one, with the tier looked up and the LoRA's path and
expectation built there once; nothing else in the package looks a tier up by name or builds that path."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lora_worker.config import LORA_DTYPE, REPO_ROOT, TIERS
from lora_worker.dispatch.request import ResolvedRequest, TrainRequest, resolve_request
from lora_worker.errors import InvalidRequest
from lora_worker.host.safetensors import ExpectedLora

PACKAGE = REPO_ROOT / "lora_worker"
RESOLVE_STEP = PACKAGE / "dispatch" / "request.py"
OUT = Path("/train/t1/output")


def raw(**overrides: object) -> TrainRequest:
    values = dict(dataset_dir="/train/t1/data-link", base_model_path="/models/m.safetensors",
                  output_dir="/train/t1/out-link", output_name="ohwx_v1", trigger="ohwx", subject_class="woman",
                  repeats=10, tier="fast", device_index=1, seed=42)
    values.update(overrides)
    return TrainRequest(**values)  # type: ignore[arg-type]


def resolved(request: TrainRequest) -> ResolvedRequest:
    return resolve_request(request, train_id="t1", dataset_dir=Path("/train/t1/dataset"),
                           base_model_path=Path("/models/m.safetensors"), output_dir=OUT)


@pytest.mark.parametrize("tier", list(TIERS))
def test_resolving_binds_the_tier_and_the_lora_the_run_must_produce(tier):
    req = resolved(raw(tier=tier, seed=7))
    assert req.tier is TIERS[tier]
    assert req.lora_file == OUT / "ohwx_v1.safetensors"
    assert req.expected == ExpectedLora(rank=TIERS[tier].network_dim, output_name="ohwx_v1",
                                        steps=TIERS[tier].max_train_steps, seed=7, dtype=LORA_DTYPE)


def test_the_resolved_paths_are_the_ones_dispatch_found_not_the_ones_sent():
    req = resolved(raw())
    assert (req.dataset_dir, req.output_dir, req.train_id) == (Path("/train/t1/dataset"), OUT, "t1")
    assert all(isinstance(p, Path) for p in (req.dataset_dir, req.output_dir, req.base_model_path, req.lora_file))


def test_the_row_records_the_resolved_request_as_text_once():
    columns = resolved(raw(tier="balanced")).row_columns()
    assert columns["dataset_dir"] == "/train/t1/dataset" and columns["output_dir"] == str(OUT)
    assert (columns["lora_file"], columns["lora_rank"], columns["lora_steps"], columns["lora_dtype"]) == (
        str(OUT / "ohwx_v1.safetensors"), 32, 1500, LORA_DTYPE)
    assert (columns["tier"], columns["total_steps"], columns["output_name"], columns["seed"]) == (
        "balanced", 1500, "ohwx_v1", 42)


def test_an_unknown_tier_is_a_field_error_not_a_crash():
    with pytest.raises(InvalidRequest) as refused:
        resolved(raw(tier="ultra"))
    assert "tier" in refused.value.fields


def test_a_raw_request_has_no_train_id_to_forget():
    # The old single type carried train_id="" until someone filled it in.
    with pytest.raises(TypeError):
        TrainRequest(**{**raw().__dict__, "train_id": "t1"})  # type: ignore[arg-type]


def _tier_lookups(source: str) -> list[int]:
    """Lines that look a tier up by name: TIERS[...] or TIERS.get(...), or the same of `tiers` or `x.tiers`
    (Settings.tiers, TIERS with a test's rig_tier_sizes)."""
    def is_tiers(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("TIERS", "tiers")) or (
            isinstance(node, ast.Attribute) and node.attr == "tiers")
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and is_tiers(node.value):
            lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and is_tiers(node.func.value)):
            lines.append(node.lineno)
    return lines


def _lora_path_builds(source: str) -> list[int]:
    """Lines that build `<output_name>.safetensors` (an f-string naming output_name, then the suffix)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            names = [ast.unparse(v.value) for v in node.values if isinstance(v, ast.FormattedValue)]
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            if any("output_name" in n for n in names) and ".safetensors" in text:
                lines.append(node.lineno)
    return lines


def test_the_detectors_see_what_they_look_for():
    assert _tier_lookups("t = TIERS[job.tier]\nu = TIERS.get(x)\nv = list(TIERS)") == [1, 2]
    assert _lora_path_builds('p = f"{job.output_dir}/{job.output_name}.safetensors"\nq = f"{x}.txt"') == [1]


def test_tiers_are_looked_up_and_the_lora_path_built_only_in_the_resolve_step():
    lookups, builds = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if found := _tier_lookups(source):
            lookups[str(path.relative_to(PACKAGE))] = found
        if found := _lora_path_builds(source):
            builds[str(path.relative_to(PACKAGE))] = found
    assert list(lookups) == ["dispatch/request.py"], lookups
    assert list(builds) == ["dispatch/request.py"], builds
    assert len(lookups["dispatch/request.py"]) == 1 and len(builds["dispatch/request.py"]) == 1

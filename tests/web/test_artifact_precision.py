"""The artifact users download: saved in fp16 (half the float32 size), as the trainer is told, and verified to
be so; the fake trainer honours --save_precision as sd-scripts' save_weights does."""
from __future__ import annotations

from pathlib import Path

import pytest

from lora_worker.config import LORA_DTYPE, SDXL_HPARAMS
from lora_worker.host.safetensors import ExpectedLora, inspect_lora, read_header, verify_lora
from lora_worker.ledger import repository as repo
from tests.helpers import SDXL_TINY, install_fake_trainer, make_dataset, write_safetensors
from tests.helpers.runs import TERMINAL, modes, submit, wait_state
from tests.helpers.fake_trainer import run

EXPECTED = ExpectedLora(rank=4, output_name="ohwx", steps=3, seed=42, dtype="F16")
METADATA = {"ss_network_dim": "4", "ss_output_name": "ohwx", "ss_max_train_steps": "3", "ss_seed": "42"}


@pytest.fixture
def rig(tmp_path: Path) -> dict:
    """The fake trainer installed, a model, the real run's dataset ("2_ohwx dog", 3 images), as test_fakes has."""
    install = install_fake_trainer(tmp_path / "opt")
    model = tmp_path / "models" / "sdxl_random.safetensors"
    write_safetensors(model, SDXL_TINY)  # the full key set the (fake) loader wants
    dataset = make_dataset(tmp_path / "train", "t1", "2_ohwx dog", images=3)
    return {**install, "model": model, "dataset": dataset, "out": tmp_path / "train" / "t1" / "output" / "run1"}


def lora(path: Path, dtype: str, alpha_dtype: str | None = None) -> Path:
    write_safetensors(path, {"lora_unet_a.lora_down.weight": (dtype, [4, 8]),
                             "lora_unet_a.lora_up.weight": (dtype, [8, 4]),
                             "lora_unet_a.alpha": (alpha_dtype or dtype, [])}, METADATA)
    return path


def test_the_recipe_saves_in_fp16_and_the_verification_expects_f16():
    assert SDXL_HPARAMS["save_precision"] == "fp16" and LORA_DTYPE == "F16"


def test_a_lora_in_the_expected_dtype_verifies(tmp_path):
    check = verify_lora(lora(tmp_path / "ohwx.safetensors", "F16"), EXPECTED)
    assert check.problem is None, check.problem


@pytest.mark.parametrize("dtype, alpha, found", [("F32", None, "3 F32"), ("BF16", None, "3 BF16"),
                                                 ("F16", "F32", "1 F32")])
def test_a_lora_of_another_dtype_is_a_mismatch_that_names_it(tmp_path, dtype, alpha, found):
    check = verify_lora(lora(tmp_path / "ohwx.safetensors", dtype, alpha), EXPECTED)
    assert check.mismatch and check.problem == f"tensors of another dtype than F16 ({found})"


@pytest.mark.parametrize("flag, dtype, bytes_per_value", [
    ((), "F32", 4), (("--save_precision=float",), "F32", 4), (("--save_precision=fp16",), "F16", 2),
    (("--save_precision=bf16",), "BF16", 2)])
@pytest.mark.slow
def test_the_fake_trainer_saves_in_the_precision_it_is_told(rig, flag, dtype, bytes_per_value):
    from safetensors.numpy import load_file  # the reference reader, not ours

    assert run(rig, "--network_dim=8", "--network_alpha=8", *flag).returncode == 0
    path = rig["out"] / "ohwx.safetensors"
    header = read_header(path)
    assert {t["dtype"] for t in header.tensors.values()} == {dtype}
    assert inspect_lora(path).dtypes == {dtype: len(header.tensors)}
    name = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    start, end = header.tensors[f"{name}.lora_down.weight"]["data_offsets"]
    assert end - start == 8 * 640 * bytes_per_value
    if dtype != "BF16":  # numpy has no bfloat16
        assert float(load_file(str(path))[f"{name}.alpha"]) == 8.0
    else:
        raw = path.read_bytes()
        data = 8 + int.from_bytes(raw[:8], "little")
        start, _ = header.tensors[f"{name}.alpha"]["data_offsets"]
        assert raw[data + start:data + start + 2] == b"\x00\x41"  # 8.0 in bfloat16


@pytest.mark.slow
def test_an_unknown_precision_is_refused_by_the_fake_as_by_argparse(rig):
    result = run(rig, "--save_precision=fp8")
    assert result.returncode == 1 and b"argument --save_precision: invalid choice" in result.stderr


@pytest.mark.slow
def test_a_job_hands_over_an_fp16_lora_half_the_size_of_float32(client, host, db):
    modes(host)
    job_id = submit(client, host)
    done = wait_state(client, job_id, *TERMINAL)
    assert done["status"] == "succeeded", done
    assert "--save_precision=fp16" in repo.get_job(db, job_id).argv
    info = inspect_lora(Path(done["lora_path"]))
    assert set(info.dtypes) == {"F16"} and info.ranks == {16}
    data_bytes = done["lora_size"] - 8 - int.from_bytes(Path(done["lora_path"]).read_bytes()[:8], "little")
    # 722 modules of dim 16: down + up weights and a scalar alpha each, 2 bytes a value
    assert data_bytes == 2 * sum(16 * (i + o) + 1 for i, o in module_features())


def module_features() -> list[tuple[int, int]]:
    """(in, out) features of the real run's 722 LoRA modules, from its header (the fake saves the same)."""
    import json

    from tests.helpers import DATA

    tensors = json.loads((DATA / "lora-header-run1_simple.json").read_text())["tensors"]
    suffix = ".lora_down.weight"
    return [(info["shape"][1], tensors[name[:-len(suffix)] + ".lora_up.weight"]["shape"][0])
            for name, info in tensors.items() if name.endswith(suffix)]

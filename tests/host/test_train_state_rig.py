"""host/train_state.py's checks against the real trainer's states (tests/data/rig): the files it requires are the
files every real state holds, and a state made of the real headers and bytes passes."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lora_worker.host.train_state import REQUIRED, check_state
from tests.helpers.fake_trainer import load_fake_trainer
from tests.helpers.rig_captures import RIG

LISTINGS = ("state-step4", "state-step8-resumed", "state-last-resumed", "state-step2-past-epoch1")


@pytest.mark.parametrize("listing", LISTINGS)
def test_the_files_a_state_must_hold_are_those_every_real_state_holds(listing):
    real = json.loads((RIG / f"{listing}.listing.json").read_text())
    assert sorted(REQUIRED) == [f["name"] for f in real]


def test_a_state_of_the_real_header_and_train_state_passes(tmp_path: Path):
    """R1's step-4 state: its model.safetensors header (F32, {"format": "pt"}; data sparse), its train_state.json's
    bytes, and zips laid out as torch.save lays them out (the fake's writer, held to the real ones' records by
    tests/test_fake_rig.py)."""
    state = tmp_path / "ohwx-step00000004-state"
    state.mkdir()
    header = json.loads((RIG / "state-step4-model.header.json").read_text())
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with (state / "model.safetensors").open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"))
    (state / "train_state.json").write_bytes((RIG / "state-step4.train_state.json").read_bytes())
    fake_states = load_fake_trainer().sd_states
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        fake_states.torch_save(str(state / name), {"state": {}}, [b"\0" * 64])
    check = check_state(str(tmp_path), state.name, rank=4)
    assert (check.problems, check.step, check.current_step, check.current_epoch) == ([], 4, 4, 1)

"""A `[devices.N]` table refuses what it does not know, like every other table of the settings file."""
from __future__ import annotations

import pytest

from lora_worker.config import load_settings
from lora_worker.errors import ConfigError

GOOD = '''
[devices.0]
label = "rtx3090-24g"
tiers = ["fast"]
train_batch_size = 1
vram_mib = { fast = 12000 }
'''


def load(tmp_path, text: str):
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return load_settings({"LORA_WORKER_CONFIG": str(path)})


def test_a_complete_device_table_loads(tmp_path):
    device = load(tmp_path, GOOD).devices[0]
    assert (device.label, device.tiers, device.train_batch_size, dict(device.vram_mib)) == (
        "rtx3090-24g", frozenset({"fast"}), 1, {"fast": 12000})


@pytest.mark.parametrize("line, named", [
    ("vram = 24000", "vram"),  # a typo of vram_mib: the limits would silently be someone else's
    ("allow_cotenancy = true", "allow_cotenancy"),  # a top-level setting put in the wrong table
])
def test_an_unknown_key_in_a_device_table_stops_the_service(tmp_path, line, named):
    with pytest.raises(ConfigError, match=rf"device 0: unknown key\(s\) \['{named}'\]"):
        load(tmp_path, GOOD + line + "\n")


def test_vram_mib_for_a_tier_that_does_not_exist_stops_the_service(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown tier\(s\) \['qualty'\]"):
        load(tmp_path, GOOD.replace("{ fast = 12000 }", "{ fast = 12000, qualty = 20000 }"))

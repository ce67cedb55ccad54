"""`lora-worker smoke`: a training per configured device through the real service (gunicorn, dispatch, the
detached supervisor, bwrap where installed) on a generated dataset, here with the simulated trainer
(tests/fakes), ending in a LoRA whose bytes are the ones the supervisor verified."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from lora_worker.host import sandbox
from lora_worker.ops import cli, smoke
from tests.helpers import fake_gpus, make_host
from tests.helpers.service import Service

pytestmark = pytest.mark.slow  # every test here starts real processes


@pytest.fixture
def served(tmp_path: Path, monkeypatch):
    from lora_worker.ledger.migrate import migrate

    host = make_host(tmp_path, sandbox="bwrap" if sandbox.bwrap_executable() else "none", trainer_kind="simulated")
    migrate(host.settings)
    monkeypatch.setattr(cli, "load_settings", lambda: host.settings)
    service = Service(host.settings, tmp_path / "gunicorn.log",
                      extra_env={"LORA_WORKER_TRAINER_KIND": "simulated"}).start()
    try:
        yield host, service
    finally:
        service.stop()


def test_smoke_trains_a_verified_lora_on_each_device_and_reports_the_figures(served, capsys):
    host, service = served
    assert cli.main(["smoke", "--url", service.url]) == 0
    out = capsys.readouterr().out
    assert "device 0: " in out, out
    for index in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"device {index}: "))
        assert "succeeded" in line and "verified" in line and " per step" in line and "MiB in use" in line, line
        assert " s wall" in line
    assert "smoke: 2/2 device(s) trained a verified LoRA" in out and "no GPU was used" in out
    images = sorted(host.settings.train_root.glob("smoke-*-d0/dataset/1_lwsmoke test pattern/*.png"))
    assert len(images) == smoke.IMAGES and images[0].read_bytes()[16:24] == bytes.fromhex("0000020000000200")


def test_smoke_fails_naming_the_device_it_could_not_use(served, capsys):
    host, service = served
    fake_gpus(host.gpus, processes0=[{"pid": 1, "used_mib": 4000}])  # something holds card 0
    assert cli.main(["smoke", "--url", service.url]) == 1
    out = capsys.readouterr().out
    assert "device 0: refused, 409 gpu_busy" in out and "smoke: 1/2 device(s)" in out


def test_a_lora_that_is_not_the_verified_one_fails_the_smoke(tmp_path):
    lora = tmp_path / "smoke.safetensors"
    header = json.dumps({"__metadata__": {}}).encode()
    lora.write_bytes(len(header).to_bytes(8, "little") + header)
    job = {"lora_path": str(lora), "lora_sha256": hashlib.sha256(lora.read_bytes()).hexdigest()}
    assert smoke.verify_lora(job) is None
    lora.write_bytes(lora.read_bytes() + b" ")
    assert "is not the verified" in smoke.verify_lora(job)
    lora.unlink()
    lora.symlink_to(tmp_path / "elsewhere")
    assert "cannot be opened" in smoke.verify_lora(job)

"""The deep health gate (dispatch/readiness.py, trainer_probe.py): each check fails for its own reason, the
service keeps one result for /healthz?deep=1, and dispatch refuses a job whose sandbox cannot start."""
from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

import pytest

from lora_worker.config import REPO_ROOT
from lora_worker.dispatch import readiness
from lora_worker.dispatch.readiness import DeepHealth, deep_checks
from lora_worker.host import sandbox
from lora_worker.host.nvml import FakeNvml
from tests.helpers import fake_gpus

PROTECT_HOME = tuple(entry for entry in readiness.HIDDEN_BY_UNIT if entry[1] == "ProtectHome=yes")
NO_UNSHARE = "#!/bin/sh\necho 'bwrap: No permissions to create new namespace, likely because the kernel does " \
             "not allow non-privileged user namespaces.' >&2\nexit 1\n"


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def broken_bwrap(tmp_path: Path) -> Path:
    script = tmp_path / "bin" / "bwrap"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(NO_UNSHARE)
    script.chmod(0o755)
    return script


def fake_interpreter(venv: Path, *, torch: str | None, cuda: bool = True, devices: int = 2,
                     bitsandbytes: bool = True) -> Path:
    """`<venv>/bin/python`: the system Python with fake torch/bitsandbytes modules on its path (or none), so the
    probe's own code runs and reads them. Inside the venv, so the sandbox binds it as it binds a real one."""
    site = venv / "lib" / "fake-site"
    site.mkdir(parents=True, exist_ok=True)
    if torch is not None:
        (site / "torch.py").write_text(textwrap.dedent(f"""\
            __version__ = {torch!r}
            class cuda:
                is_available = staticmethod(lambda: {cuda!r})
                device_count = staticmethod(lambda: {devices!r})
            """))
    if bitsandbytes:
        (site / "bitsandbytes.py").write_text("__version__ = '0.45.0'\nprint('bitsandbytes banner on stdout')\n")
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec /usr/bin/python3 -S "$@"\n')
    python.chmod(0o755)
    return python


def with_interpreter(settings, python: Path):
    launcher = settings.accelerate
    launcher.write_text(f"#!{python}\n" + launcher.read_text().split("\n", 1)[1])
    return settings


# -- bwrap's namespaces ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_bwrap_that_cannot_unshare_fails_the_sandbox_check_with_its_own_words(migrated, tmp_path):
    settings = migrated.with_overrides(sandbox="bwrap", bwrap_path=broken_bwrap(tmp_path))
    check = by_name(deep_checks(settings, FakeNvml.from_file(settings.nvml_fake_file), trainer=False))["sandbox"]
    assert check.failed and "No permissions to create new namespace" in check.detail


def test_without_bwrap_at_its_setting_the_sandbox_check_says_install_it(migrated, tmp_path):
    settings = migrated.with_overrides(sandbox="bwrap", bwrap_path=tmp_path / "nowhere" / "bwrap")
    check = by_name(deep_checks(settings, FakeNvml.from_file(settings.nvml_fake_file), trainer=False))["sandbox"]
    assert check.failed and "apt-get install bubblewrap" in check.detail


@pytest.mark.slow
def test_dispatch_refuses_503_sandbox_unavailable_when_the_start_up_probe_failed(migrated, tmp_path, launches):
    from lora_worker import create_app
    from tests.helpers import payload

    settings = migrated.with_overrides(sandbox="bwrap", bwrap_path=broken_bwrap(tmp_path))
    app = create_app(settings, launch=launches, deep_health=True)
    try:
        app.extensions["lora_worker"].deep_health.wait(30)
        client = app.test_client()
        dataset = settings.train_root / "t1" / "dataset"
        response = client.post("/train", json=payload(dataset, settings.model_dirs[0] / "sdxl_tiny.safetensors"))
        assert response.status_code == 503, response.get_json()
        body = response.get_json()
        assert body["error"] == "sandbox_unavailable" and "No permissions to create new namespace" in body["message"]
        assert launches == []
    finally:
        app.extensions["lora_worker"].db.dispose()


@pytest.mark.slow
def test_the_probe_is_made_once_and_kept(migrated, tmp_path):
    script = broken_bwrap(tmp_path)
    counter = tmp_path / "calls"
    script.write_text(f"#!/bin/sh\necho x >> {counter}\n" + NO_UNSHARE.split("\n", 1)[1])
    settings = migrated.with_overrides(sandbox="bwrap", bwrap_path=script)
    first = sandbox.probed_problem(settings)
    assert first and sandbox.probed_problem(settings) == first
    assert counter.read_text().count("x") == 1


# -- NVML and the device nodes -----------------------------------------------------------------------------------

def test_a_card_whose_process_list_cannot_be_read_fails(migrated):
    fake_gpus(migrated.nvml_fake_file)
    doc = json.loads(migrated.nvml_fake_file.read_text())
    doc["devices"][1]["processes_error"] = "NVMLError_NoPermission: Insufficient Permissions"
    migrated.nvml_fake_file.write_text(json.dumps(doc))
    checks = by_name(deep_checks(migrated, FakeNvml.from_file(migrated.nvml_fake_file), trainer=False))
    assert checks["nvml process list 0"].ok
    assert checks["nvml process list 1"].failed and "Insufficient Permissions" in checks["nvml process list 1"].detail


def test_without_a_driver_the_process_list_check_says_nothing_can_train(migrated):
    checks = by_name(deep_checks(migrated, FakeNvml(absent=True), trainer=False))
    assert checks["nvml process lists"].failed and "nothing can train here" in checks["nvml process lists"].detail


@pytest.mark.parametrize("present, missing", [
    (("nvidiactl", "nvidia0", "nvidia1"), "nvidia-uvm"),
    (("nvidia-uvm", "nvidia0", "nvidia1"), "nvidiactl"),
    (("nvidiactl", "nvidia-uvm", "nvidia0"), "nvidia1"),
])
def test_a_missing_device_node_fails_and_names_it(migrated, tmp_path, present, missing):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in present:
        (dev / name).touch()
    check = readiness.device_node_check(migrated.with_overrides(dev_root=dev), None)
    assert check.failed and f"missing {missing}" in check.detail and "nvidia-modprobe" in check.detail
    (dev / missing).touch()
    assert readiness.device_node_check(migrated.with_overrides(dev_root=dev), None).ok


# -- what the unit hides -----------------------------------------------------------------------------------------

def test_the_hidden_paths_are_what_the_unit_hides():
    unit = (REPO_ROOT / "systemd" / "lora-worker.service.in").read_text()
    lines = {line.strip() for line in unit.splitlines() if not line.lstrip().startswith("#")}
    assert "ProtectHome=yes" in lines and "PrivateTmp=yes" in lines
    hidden = {str(path): why for path, why in readiness.HIDDEN_BY_UNIT}
    assert hidden == {"/home": "ProtectHome=yes", "/root": "ProtectHome=yes", "/run/user": "ProtectHome=yes",
                      "/tmp": "PrivateTmp=yes", "/var/tmp": "PrivateTmp=yes"}


@pytest.mark.parametrize("interpreter", ["/home/infra/.pyenv/versions/3.11.9/bin/python3.11",
                                         "/root/.local/share/uv/python/cpython-3.11/bin/python3"])
def test_a_trainer_interpreter_under_home_or_root_fails(migrated, monkeypatch, interpreter):
    monkeypatch.setattr(readiness, "HIDDEN_BY_UNIT", PROTECT_HOME)  # the test host itself lives in /tmp
    with_interpreter(migrated, Path(interpreter))
    check = readiness.hidden_paths_check(migrated)
    assert check.failed and "ProtectHome=yes" in check.detail and interpreter.split("/")[1] in check.detail
    with_interpreter(migrated, Path("/usr/bin/python3"))
    assert readiness.hidden_paths_check(migrated).ok


def test_a_venv_python_linked_into_home_fails_by_where_it_resolves(migrated, monkeypatch, tmp_path):
    monkeypatch.setattr(readiness, "HIDDEN_BY_UNIT", PROTECT_HOME)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to("/home/infra/.pyenv/versions/3.11.9/bin/python3.11")  # as `uv venv` leaves it
    check = readiness.hidden_paths_check(with_interpreter(migrated, python))
    assert check.failed and "→ /home/infra/.pyenv" in check.detail


# -- the trainer in its sandbox ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sandboxed", ["none", "bwrap"])
def test_an_interpreter_without_torch_fails_the_trainer_check(migrated, tmp_path, sandboxed):
    if sandboxed == "bwrap" and sandbox.bwrap_executable() is None:
        pytest.skip("bubblewrap is not installed")
    venv = migrated.accelerate.parent.parent
    settings = with_interpreter(migrated.with_overrides(sandbox=sandboxed), fake_interpreter(venv, torch=None))
    check = by_name(deep_checks(settings, FakeNvml.from_file(settings.nvml_fake_file)))["trainer in the sandbox"]
    assert check.failed and "cannot import torch: ModuleNotFoundError: No module named 'torch'" in check.detail


@pytest.mark.parametrize("fake, says", [
    ({"torch": "2.7.0", "cuda": False}, "torch 2.7.0 sees no CUDA device though NVML shows 2"),
    ({"torch": "2.7.0", "devices": 1}, "sees 1 CUDA device(s), NVML 2"),
    ({"torch": "2.7.0", "bitsandbytes": False}, "bitsandbytes does not load: ModuleNotFoundError"),
])
@pytest.mark.slow
def test_the_trainer_check_fails_for_each_reason(migrated, fake, says):
    venv = migrated.accelerate.parent.parent
    settings = with_interpreter(migrated, fake_interpreter(venv, **fake))
    check = by_name(deep_checks(settings, FakeNvml.from_file(settings.nvml_fake_file)))["trainer in the sandbox"]
    assert check.failed and says in check.detail


@pytest.mark.slow
def test_through_bwrap_a_good_trainer_passes_with_the_jobs_environment(migrated):
    if sandbox.bwrap_executable() is None:
        pytest.skip("bubblewrap is not installed")
    venv = migrated.accelerate.parent.parent
    settings = with_interpreter(migrated.with_overrides(sandbox="bwrap"), fake_interpreter(venv, torch="2.7.0"))
    check = by_name(deep_checks(settings, FakeNvml.from_file(settings.nvml_fake_file)))["trainer in the sandbox"]
    assert check.ok, check.detail
    assert re.search(r"torch 2\.7\.0, CUDA with 2 device\(s\), bitsandbytes 0\.45\.0", check.detail)


@pytest.mark.slow
def test_on_a_host_without_a_gpu_the_trainer_check_says_so(migrated):
    venv = migrated.accelerate.parent.parent
    settings = with_interpreter(migrated, fake_interpreter(venv, torch="2.7.0+cpu", cuda=False))
    check = by_name(deep_checks(settings, FakeNvml(absent=True)))["trainer in the sandbox"]
    assert check.failed and "no GPU on this host" in check.detail


@pytest.mark.slow
def test_the_simulated_trainer_passes_only_what_it_can_and_says_what_it_simulated(migrated):
    settings = migrated.with_overrides(trainer_kind="simulated")
    checks = by_name(deep_checks(settings, FakeNvml.from_file(settings.nvml_fake_file)))
    trainer = checks["trainer in the sandbox"]
    assert trainer.ok and trainer.simulated and "torch, CUDA and bitsandbytes simulated" in trainer.detail
    assert checks["device nodes /dev"].simulated and checks["trainer outside the unit's hidden paths"].simulated
    assert "[ sim]" in trainer.line()


# -- the service keeps the result --------------------------------------------------------------------------------

@pytest.mark.slow
def test_healthz_deep_serves_the_start_up_result_and_never_runs_the_checks_itself(migrated, monkeypatch):
    from lora_worker import create_app

    calls = []
    real = readiness.deep_checks

    def counted(*args, **kwargs):
        calls.append(1)
        time.sleep(0.3)  # while it runs, the gate reads pending
        return real(*args, **kwargs)

    monkeypatch.setattr(readiness, "deep_checks", counted)
    monkeypatch.setattr(readiness, "HIDDEN_BY_UNIT", ())  # the test host lives in /tmp
    settings = with_interpreter(migrated, fake_interpreter(migrated.accelerate.parent.parent, torch="2.7.0"))
    dev = settings.state_dir / "fake-dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"):
        (dev / name).touch()
    app = create_app(settings.with_overrides(dev_root=dev), deep_health=True)
    try:
        client = app.test_client()
        pending = client.get("/healthz?deep=1")
        assert pending.status_code == 503 and pending.get_json()["error"] == "host_not_ready"
        assert pending.get_json()["details"]["deep"]["status"] == "pending"
        assert client.get("/healthz").status_code == 200  # the bare liveness answer is unchanged
        app.extensions["lora_worker"].deep_health.wait(60)
        for _ in range(3):
            done = client.get("/healthz?deep=1")
        body = done.get_json()
        assert done.status_code == 200, body
        assert body["deep"]["status"] == "ok" and calls == [1]
        assert {c["name"] for c in body["deep"]["checks"]} >= {"sandbox", "device nodes " + str(dev),
                                                               "trainer in the sandbox"}
    finally:
        app.extensions["lora_worker"].db.dispose()


@pytest.mark.slow
def test_healthz_deep_is_503_naming_what_failed(migrated):
    health = DeepHealth(migrated.with_overrides(dev_root=migrated.state_dir), FakeNvml(absent=True))
    result = health.run()
    assert result["status"] == "failing"
    assert {"nvml process lists", "trainer in the sandbox"} <= set(result["failed"])

"""`make demo` (`lora-worker demo`): from a fresh clone, a simulated host trains one LoRA to `succeeded` over the
real service; the simulation is labelled on /healthz, in doctor and in the run log; a deployed worker can
never enable it; and `lora-worker config` (what `make run` prints first) says where the settings came from."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from safetensors import safe_open

from lora_worker.config import REPO_ROOT, load_settings
from lora_worker.errors import ConfigError
from lora_worker.ops.banner import describe
from lora_worker.ops.doctor import run_checks
from lora_worker.host.nvml import FakeNvml
from lora_worker.transcript.logreader import LogReader
from tests.helpers import install_script, wait_for
from tests.helpers.service import free_port

DEPLOYED_ONLY = ("INVOCATION_ID", "CREDENTIALS_DIRECTORY")


def clean_env(**extra: str) -> dict[str, str]:
    """This shell's environment without anything that configures a worker or says "systemd"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA_WORKER_") and k not in DEPLOYED_ONLY}
    return {**env, **extra}


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def post(url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Lines:
    """A child's stdout, collected line by line in a thread, waited on by content."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stdout is not None
        self._stdout = proc.stdout
        self._thread = threading.Thread(target=lambda: self.lines.extend(iter(self._stdout.readline, "")))
        self._thread.start()

    def close(self) -> None:
        self._thread.join(30)
        self._stdout.close()

    def wait_for(self, text: str, timeout: float) -> None:
        wait_for(lambda: any(text in line for line in self.lines), timeout=timeout, interval=0.2,
                 what=f"{text!r} in the demo's output:\n" + "".join(self.lines))

    @property
    def text(self) -> str:
        return "".join(self.lines)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_make_demos_flow_from_a_fresh_clone_trains_a_verified_lora_and_labels_the_simulation(tmp_path: Path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # What `make demo` runs, from the clone's code: this venv's python, the clone first on the import path.
    # The system python3 (first on the trainer's restricted PATH) has no tqdm: the launcher must not use it.
    env = clean_env(PYTHONPATH=str(clone))
    started = time.monotonic()
    demo = subprocess.Popen([sys.executable, "-m", "lora_worker.ops.cli", "demo", "--bind", f"127.0.0.1:{port}"],
                            cwd=clone, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = Lines(demo)
    try:
        out.wait_for("Ctrl-C stops it", timeout=240)
        wall_s = time.monotonic() - started
        root = clone / "var" / "demo"
        assert (root / "ledger.sqlite3").is_file()  # the ledger lives under ./var/demo of the clone
        launcher = root / "trainer" / "venv" / "bin" / "accelerate"
        assert launcher.read_text().splitlines()[0] == f"#!{sys.executable}"

        job = get(f"{url}/train/1")
        assert job["status"] == "succeeded", job
        assert job["tier"] == "fast" and job["total_steps"] == 400 and job["step"] == 400  # TIERS untouched
        lora = Path(job["lora_path"])
        assert lora.is_relative_to(root / "train")
        with safe_open(str(lora), framework="np") as f:  # the reference reader, not the worker's own
            meta = f.metadata()
            downs = [k for k in f.keys() if k.endswith(".lora_down.weight")]  # noqa: SIM118 - safe_open is no dict
        assert meta["ss_network_dim"] == "16" and meta["ss_output_name"] == "ohwx_lora" and meta["ss_seed"] == "42"
        assert len(downs) == 722
        assert f"verified {lora.relative_to(clone)}: {lora.stat().st_size} bytes" in out.text

        # The simulation says what it is: /healthz, doctor, and the run log's first line.
        assert get(f"{url}/healthz")["trainer"] == "simulated"
        doctor = subprocess.run([sys.executable, "-m", "lora_worker.ops.cli", "doctor"], cwd=clone,
                                env={**env, "LORA_WORKER_CONFIG": str(root / "worker.toml"),
                                     "LORA_WORKER_TRAINER_KIND": "simulated"},
                                capture_output=True, text=True, timeout=60)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "[  ok] trainer: simulated" in doctor.stdout
        first = get(f"{url}/train/1/log?offset=0&limit=200")["text"].splitlines()[0]
        assert first.startswith("[lora-worker] SIMULATED trainer")

        # It went through the real pieces: a 409 for the TTS card, then the job on the 48 GB card.
        assert re.search(r"POST /train on GPU 0 → 409 gpu_busy: GPU 0 is in use by tts_server", out.text)
        assert "tts_on_3090: true" in out.text
        assert re.search(r"job 1: running \(training\), step \d+/400", out.text)
        # Each event of the job reached the demo's own receiver, signed, in order.
        out.wait_for("webhook ← job.succeeded", timeout=60)
        arrived = re.findall(r"webhook ← (job\.\w+).*\(signature verified\)", out.text)
        assert arrived[:2] == ["job.queued", "job.started"] and arrived[-1] == "job.succeeded", arrived
        assert "job.phase" in arrived and "REFUSED" not in out.text
        timing = float(re.search(r"a verified LoRA ([\d.]+) s after the demo started", out.text)[1])
        assert timing < 90, timing  # "well under a minute" on an idle machine; this box is shared

        # The printed dispatch command works as printed (same body file), and Ctrl-C cancels what still runs.
        command = next(line for line in out.lines if "curl -s -X POST" in line and "/train " in line)
        body_file = clone / re.search(r"-d @(\S+)", command)[1]
        status, answer = post(f"{url}/train", json.loads(body_file.read_text()))
        assert status == 202, answer
        tts_pid = json.loads((root / "gpus.json").read_text())["devices"][0]["processes"][0]["pid"]
        demo.send_signal(signal.SIGINT)
        assert demo.wait(120) == 0, out.text
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        out.close()
    conn = sqlite3.connect(root / "ledger.sqlite3")
    try:
        assert conn.execute("SELECT status FROM jobs WHERE id = ?", (answer["worker_job_id"],)).fetchone() \
            == ("cancelled",)
    finally:
        conn.close()
    assert "server stopped" in out.text
    assert not psutil.pid_exists(tts_pid) or psutil.Process(tts_pid).status() == psutil.STATUS_ZOMBIE
    print(f"\nmake demo's flow from a fresh clone: 'Ctrl-C stops it' after {wall_s:.1f} s\n{out.text}")


# -- the deployed worker can never be simulated ---------------------------------------------------------------

def test_the_simulated_trainer_is_allowed_for_a_development_server_from_the_environment():
    settings = load_settings(clean_env(LORA_WORKER_TRAINER_KIND="simulated"))
    assert settings.simulated and settings.trainer_kind == "simulated"
    assert not load_settings(clean_env()).simulated  # the default is the real trainer


def test_a_config_file_cannot_enable_the_simulated_trainer(tmp_path: Path):
    config = tmp_path / "worker.toml"
    config.write_text('trainer_kind = "simulated"\n')
    with pytest.raises(ConfigError, match="refused in a config file"):
        load_settings(clean_env(LORA_WORKER_CONFIG=str(config)))
    config.write_text('trainer_kind = "sd-scripts"\n')  # the real one may be named
    assert load_settings(clean_env(LORA_WORKER_CONFIG=str(config))).trainer_kind == "sd-scripts"


@pytest.mark.parametrize("deployed", [{"INVOCATION_ID": "5f1c"}, {"CREDENTIALS_DIRECTORY": "/run/credentials/x"},
                                      {"LORA_WORKER_API_TOKEN_FILE": "/etc/lora-worker/api_token"}])
def test_the_simulated_trainer_is_refused_under_systemd_or_with_a_token(deployed: dict[str, str]):
    with pytest.raises(ConfigError, match="development server only"):
        load_settings(clean_env(LORA_WORKER_TRAINER_KIND="simulated", **deployed))


def test_the_installed_unit_with_its_config_refuses_to_start_a_simulated_worker(tmp_path: Path, monkeypatch):
    # The deployed worker.toml as install.py writes it, under the environment systemd gives the unit.
    config = tmp_path / "worker.toml"
    config.write_text((mod := install_script()).config_text(mod.Identities()))
    for name, value in clean_env(LORA_WORKER_CONFIG=str(config), LORA_WORKER_TRAINER_KIND="simulated",
                                 INVOCATION_ID="5f1c", CREDENTIALS_DIRECTORY=str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    from lora_worker.web.app import build_app

    with pytest.raises(ConfigError, match="development server only"):
        build_app()


def test_an_unknown_trainer_kind_stops_the_service():
    with pytest.raises(ConfigError, match="trainer_kind"):
        load_settings(clean_env(LORA_WORKER_TRAINER_KIND="fluxgym"))


# -- the label, where the simulation shows ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["simulated", "sd-scripts"])
def test_healthz_names_the_trainer_kind(migrated, kind: str):
    from lora_worker import create_app

    app = create_app(migrated.with_overrides(trainer_kind=kind))
    try:
        assert app.test_client().get("/healthz").get_json()["trainer"] == kind
    finally:
        app.extensions["lora_worker"].db.dispose()


def test_doctor_says_the_trainer_is_simulated_and_says_nothing_of_the_kind_otherwise(migrated):
    nvml = FakeNvml.from_file(migrated.nvml_fake_file)
    line = next(c.line() for c in run_checks(migrated.with_overrides(trainer_kind="simulated"), nvml)
                if c.name == "trainer")
    assert line.startswith("[  ok] trainer: simulated (")
    real = next(c.line() for c in run_checks(migrated, nvml) if c.name == "trainer")
    assert "simulated" not in real


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["simulated", "sd-scripts"])
def test_the_run_logs_first_line_says_when_the_trainer_is_simulated(migrated, host, kind: str):
    from lora_worker import create_app

    settings = migrated.with_overrides(trainer_kind=kind)
    app = create_app(settings)
    try:
        client = app.test_client()
        job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
        wait_for(lambda: client.get(f"/train/{job_id}").get_json()["status"] == "succeeded", what="success")
    finally:
        app.extensions["lora_worker"].db.dispose()
    first = LogReader(settings.log_dir, job_id).read_from(0, 4096).text.splitlines()[0]
    assert first.startswith("[lora-worker] ")
    assert ("SIMULATED trainer" in first) == (kind == "simulated")
    assert f"job {job_id}: " in first


# -- `lora-worker config`: what `make run` prints before gunicorn starts ---------------------------------------

def test_config_says_which_file_and_variables_made_the_settings_and_what_to_try_next(tmp_path: Path):
    config = tmp_path / "worker.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    environ = clean_env(LORA_WORKER_CONFIG=str(config), LORA_WORKER_RETENTION_DAYS="7")
    out = io.StringIO()
    describe(load_settings(environ), out, environ, bind="127.0.0.1:8203")
    text = out.getvalue()
    assert text.splitlines()[0] == (f"lora-worker settings, from built-in defaults (lora_worker/config.py); then "
                                    f"the file {config} (LORA_WORKER_CONFIG); then the environment: "
                                    "LORA_WORKER_RETENTION_DAYS")
    assert "127.0.0.1:8203 (no API token: development mode, loopback only)" in text
    assert f"state dir:   {tmp_path / 'state'}" in text
    assert "curl -s http://127.0.0.1:8203/healthz" in text and "make demo" in text


def test_config_with_nothing_set_says_defaults_only():
    out = io.StringIO()
    describe(load_settings(clean_env()), out, clean_env())
    assert out.getvalue().splitlines()[0] == "lora-worker settings, from built-in defaults (lora_worker/config.py)"

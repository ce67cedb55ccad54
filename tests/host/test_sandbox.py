"""The trainer's sandbox (bubblewrap): only the job's paths exist for it, and its processes die with the
supervisor, however they hide. Real jobs through the real supervisor, with trainers that try to get out."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from lora_worker.config import Settings
from lora_worker.host import sandbox
from lora_worker.ledger import repository as repo
from tests.helpers import make_host, pid_alive, wait_for
from tests.helpers.sandbox import hostile_trainer, needs_bwrap, submit, wait_state



@pytest.fixture
def host(tmp_path: Path):
    return make_host(tmp_path, sandbox="bwrap")


# -- a real run ------------------------------------------------------------------------------------------------

@needs_bwrap
@pytest.mark.slow
def test_the_fake_trainer_succeeds_inside_the_sandbox(client, host):
    job_id = submit(client, host)
    done = wait_state(client, job_id)
    assert (done["status"], done["failure_class"]) == ("succeeded", None), done
    assert "sandbox: bwrap (" in client.get(f"/train/{job_id}/log?offset=0").get_json()["text"]
    # its sample prompts read from the state dir, which the sandbox otherwise hides: a pass at each save drew them
    images = client.get(f"/train/{job_id}/samples").get_json()["images"]
    assert [i["step"] for i in images] == [0, 100, 200, 300, 400]


# -- what the trainer can reach --------------------------------------------------------------------------------

@needs_bwrap
@pytest.mark.slow
def test_a_hostile_trainer_reads_and_writes_nothing_outside_the_jobs_paths(client, host, migrated):
    settings: Settings = migrated
    other = host.settings.train_root / "t2" / "dataset" / "10_x y"
    other.mkdir(parents=True)
    (other / "secret.txt").write_text("another train id's caption")
    (settings.state_dir / "api_token").write_text("x" * 40)
    fd, home_secret = tempfile.mkstemp(dir=Path.home(), prefix=".lora-worker-sandbox-test-")
    os.write(fd, b"a secret in a home directory")
    os.close(fd)
    listener = socket.create_server(("127.0.0.1", 0))
    targets = {
        "read": {"other_train_id": str(other / "secret.txt"), "ledger": str(settings.database_path),
                 "token": str(settings.state_dir / "api_token"), "home": home_secret,
                 "host_root_dir": str(Path.home())},
        "write": {"other_train_id": str(other.parent / "evil.txt"),
                  "dataset": str(host.dataset / "evil.txt"), "sd_scripts": str(host.sd_scripts / "evil.txt"),
                  "state_dir": str(settings.state_dir / "evil.txt"),
                  "tmp": f"/tmp/lora-worker-sandbox-evil-{os.getpid()}-{time.time_ns()}.txt",
                  "train_root": str(host.settings.train_root / "evil.txt")},
        "port": listener.getsockname()[1],
    }
    (host.sd_scripts / "targets.json").write_text(json.dumps(targets))
    try:
        hostile_trainer(host, f"""
            import socket
            targets = json.load(open({str(host.sd_scripts / "targets.json")!r}))
            report = {{"read": {{}}, "write": {{}}}}
            for name, path in targets["read"].items():
                try:
                    report["read"][name] = os.listdir(path) if os.path.isdir(path) else open(path, "rb").read(200).decode(errors="replace")
                except OSError as exc:
                    report["read"][name] = None
            for name, path in targets["write"].items():
                try:
                    with open(path, "w") as fh:
                        fh.write("escaped")
                    report["write"][name] = "written (inside the sandbox)"
                except OSError as exc:
                    report["write"][name] = repr(exc)
            try:
                socket.create_connection(("127.0.0.1", targets["port"]), timeout=2).close()
                report["network"] = "connected"
            except OSError as exc:
                report["network"] = repr(exc)
            report["processes"] = sorted(open(f"/proc/{{p}}/cmdline").read().replace("\\0", " ")
                                         for p in os.listdir("/proc") if p.isdigit())
            # What the job needs must still work: its dataset config and dataset read, its output dir writes.
            config = open(args["dataset_config"]).read()
            report["config"] = config
            report["dataset"] = sorted(os.listdir(config.split("image_dir = '")[1].split("'")[0]))
            report["beside_config"] = sorted(os.listdir(os.path.dirname(args["dataset_config"])))
            try:
                open(args["dataset_config"], "a").close()
                report["config_written"] = True
            except OSError:
                report["config_written"] = False
            with open(os.path.join(args["output_dir"], "report.json"), "w") as fh:
                json.dump(report, fh)
            sys.exit(1)
        """)
        done = wait_state(client, submit(client, host))
    finally:
        listener.close()
        os.unlink(home_secret)
    report_file = host.dataset.parent / "output" / "report.json"
    assert report_file.exists(), done["error"]
    report = json.loads(report_file.read_text())
    assert done["status"] == "failed"
    assert report["dataset"] == sorted(os.listdir(host.dataset / "10_ohwx woman"))  # the job's own paths are there
    assert "num_repeats = " in report["config"] and not report["config_written"]  # its config, read-only
    assert len(report["beside_config"]) == 1  # nothing else of the state dir: only the one file bound
    # The home dir exists in the sandbox only as the path to the interpreter (pyenv) when it lives there.
    home_view = report["read"].pop("host_root_dir")
    assert home_view is None or Path(home_secret).name not in home_view
    assert report["read"] == {name: None for name in targets["read"] if name != "host_root_dir"}, report["read"]
    for name, path in targets["write"].items():
        assert not os.path.exists(path), f"{name}: {path} was written on the host ({report['write'][name]})"
    assert report["network"] != "connected"
    # Only the job's own processes exist: the namespace's init (bwrap), the launcher and the trainer.
    assert len(report["processes"]) == 3, report["processes"]
    assert [cmd.split()[0] for cmd in report["processes"]].count(str(sandbox.bwrap_executable())) == 1
    assert sum(str(host.settings.train_script) in cmd for cmd in report["processes"]) == 3


# -- every process dies with the supervisor ---------------------------------------------------------------------

ESCAPEE = "lora-worker-escapee-{}"


@needs_bwrap
@pytest.mark.slow
def test_a_process_that_left_the_group_and_renamed_itself_dies_with_the_supervisor(client, host, db):
    marker = ESCAPEE.format(os.getpid())
    hostile_trainer(host, f"""
        import time
        if os.fork() == 0:
            os.setsid()  # out of the job's process group and session
            # Re-exec'd under another name: nothing in its argv says whose it is.
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}])
        time.sleep(600)
    """)
    job_id = submit(client, host)
    escapee = wait_for(lambda: next((p for p in psutil.process_iter(["cmdline"])
                                     if marker in (p.info["cmdline"] or ())), None), what="the escapee")
    job = wait_for(lambda: (j := repo.get_job(db, job_id)).trainer_pid and j, what="the trainer's pid")
    assert os.getsid(escapee.pid) != os.getsid(job.trainer_pid)  # it really left the job's session
    assert not any(a.startswith("--output_dir=") for a in escapee.cmdline())
    os.kill(job.supervisor_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(escapee.pid), timeout=5, what="the escapee to die with the supervisor")
    assert not pid_alive(job.trainer_pid)
    done = client.get(f"/train/{job_id}").get_json()  # the next request reconciles
    assert (done["status"], done["failure_class"]) == ("failed", "supervisor_lost")
    assert "killed" not in done["error"] and "no process of the job was left" in done["error"], done["error"]


# -- the command and the setting --------------------------------------------------------------------------------

def facts(**overrides) -> sandbox.HostFacts:
    values = dict(bwrap="/usr/bin/bwrap", interpreter_dirs=(Path("/opt/python3.11"),),
                  device_nodes=(Path("/dev/nvidia0"), Path("/dev/nvidiactl"), Path("/dev/nvidia-uvm")),
                  usr_aliases=(("lib", "usr/lib"), ("bin", "usr/bin")), etc_files=(Path("/etc/ld.so.cache"),),
                  sys_parts=(Path("/sys/bus"), Path("/sys/devices")))
    values.update(overrides)
    return sandbox.HostFacts(**values)  # type: ignore[arg-type]


def binds(cmd: list[str]) -> dict[str, str]:
    """{path: how} for every mount in a bwrap command line (before `--`)."""
    found, args = {}, cmd[:cmd.index("--")]
    for i, arg in enumerate(args):
        if arg in ("--ro-bind", "--bind", "--dev-bind"):
            found[args[i + 2]] = arg
        elif arg in ("--ro-bind-fd", "--bind-fd"):
            found[args[i + 2]] = f"{arg} {args[i + 1]}"
        elif arg in ("--tmpfs", "--proc", "--dev"):
            found[args[i + 1]] = arg
        elif arg == "--symlink":
            found[args[i + 2]] = f"--symlink {args[i + 1]}"
    return found


def test_the_command_mounts_the_jobs_paths_and_nothing_else_of_the_host():
    settings = Settings(sandbox="bwrap", state_dir=Path("/var/lib/lora-worker"),
                        accelerate=Path("/opt/fluxgym/.venv/bin/accelerate"))
    job = sandbox.JobPaths(Path("/train/7/dataset"), Path("/models/sdxl.safetensors"), Path("/train/7/output"))
    argv = [str(settings.accelerate), "launch", "--output_dir=/train/7/output"]
    held = {Path("/train/7/dataset"): 7, Path("/train/7/dataset/10_x y"): 8, Path("/train/7/output"): 9}
    cmd = sandbox.wrap(argv, job, settings, facts(), held)
    assert cmd[-len(argv):] == argv and cmd[cmd.index("--") + 1:] == argv
    assert {"--unshare-pid", "--die-with-parent", "--unshare-net"} <= set(cmd)
    assert binds(cmd) == {
        "/usr": "--ro-bind", "/lib": "--symlink usr/lib", "/bin": "--symlink usr/bin",
        "/etc/ld.so.cache": "--ro-bind", "/proc": "--proc", "/proc/sys": "--ro-bind", "/dev": "--dev",
        "/dev/shm": "--tmpfs",
        "/dev/nvidia0": "--dev-bind", "/dev/nvidiactl": "--dev-bind", "/dev/nvidia-uvm": "--dev-bind",
        "/sys/bus": "--ro-bind", "/sys/devices": "--ro-bind",
        # Private scratch; the state dir's path is an empty tmpfs (HOME), none of its files.
        "/tmp": "--tmpfs", "/var/lib/lora-worker": "--tmpfs", "/var/lib/lora-worker/hf": "--tmpfs",
        "/opt/python3.11": "--ro-bind", "/opt/fluxgym/.venv": "--ro-bind", "/opt/fluxgym/sd-scripts": "--ro-bind",
        "/opt/fluxgym/tokenizers": "--ro-bind", "/models/sdxl.safetensors": "--ro-bind",
        # The job's directories: the descriptors the pre-exec check opened, never the paths again.
        "/train/7/dataset": "--ro-bind-fd 7", "/train/7/dataset/10_x y": "--ro-bind-fd 8",
        "/train/7/output": "--bind-fd 9",
    }
    assert "--unshare-user" not in cmd  # not root: bwrap makes its user namespace itself
    assert cmd[cmd.index("--chdir") + 1] == "/opt/fluxgym/sd-scripts"


def test_an_output_dir_inside_a_read_only_path_is_mounted_after_it():
    settings = Settings(sandbox="bwrap")
    job = sandbox.JobPaths(Path("/train/7"), Path("/models/m.safetensors"), Path("/train/7/output"))
    cmd = sandbox.wrap(["x"], job, settings, facts(), {job.dataset_dir: 3, job.output_dir: 4})
    assert cmd.index("/train/7/output") > cmd.index("/train/7")


def test_the_sample_prompts_file_is_bound_read_only_over_the_state_dirs_tmpfs():
    """The prompts file the argv names (dispatch/samples.py) lies in the state dir, which the trainer sees as an
    empty tmpfs: it is bound read-only there, after the tmpfs, and nothing else of the state dir is."""
    settings = Settings(sandbox="bwrap", state_dir=Path("/var/lib/lora-worker"))
    prompts = "/var/lib/lora-worker/prompts/0123abcd.json"
    argv = ["x", f"--sample_prompts={prompts}", "--sample_every_n_steps=100", "--output_dir=/train/7/output"]
    assert sandbox.argv_files(argv) == (Path(prompts),)
    job = sandbox.JobPaths(Path("/train/7/dataset"), Path("/models/m.safetensors"), Path("/train/7/output"),
                           read_only=sandbox.argv_files(argv))
    cmd = sandbox.wrap(argv, job, settings, facts(), {job.dataset_dir: 3, job.output_dir: 4})
    mounts = binds(cmd)
    assert mounts[prompts] == "--ro-bind" and mounts["/var/lib/lora-worker"] == "--tmpfs"
    assert cmd.index(prompts) > cmd.index("/var/lib/lora-worker")
    assert [p for p in mounts if p.startswith("/var/lib/lora-worker/")] == ["/var/lib/lora-worker/hf", prompts]


def test_sandbox_none_runs_the_stored_argv_itself():
    job = sandbox.JobPaths(Path("/d"), Path("/m"), Path("/o"))
    assert sandbox.wrap(["a", "b"], job, Settings(sandbox="none"), facts(bwrap=None)) == ["a", "b"]


def test_the_sandbox_setting_defaults_to_bwrap_and_refuses_anything_else():
    from lora_worker.config import load_settings
    from lora_worker.errors import ConfigError

    assert Settings().sandbox == "bwrap" and load_settings({}).sandbox == "bwrap"
    assert load_settings({"LORA_WORKER_SANDBOX": "none"}).sandbox == "none"
    with pytest.raises(ConfigError, match="sandbox"):
        load_settings({"LORA_WORKER_SANDBOX": "firejail"})


def test_the_interpreter_of_the_launcher_and_its_venv_are_found(tmp_path):
    launcher = tmp_path / "venv" / "bin" / "accelerate"
    launcher.parent.mkdir(parents=True)
    launcher.write_text(f"#!{sys.executable}\nprint()\n")
    dirs = sandbox.host_facts(Settings(accelerate=launcher)).interpreter_dirs
    real = Path(os.path.realpath(sys.executable))
    assert any(real.is_relative_to(d) for d in dirs) or real.is_relative_to("/usr")


# -- without bubblewrap ------------------------------------------------------------------------------------------

def test_without_bubblewrap_post_train_is_a_503_naming_it_and_changes_nothing(api, host, launches, monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_executable", lambda: None)
    response = api.post("/train", json=host.payload())
    assert response.status_code == 503, response.get_json()
    body = response.get_json()
    assert body["error"] == "sandbox_unavailable" and "bubblewrap" in body["message"]
    assert "apt-get install bubblewrap" in body["message"] and launches == []
    health = api.get("/healthz").get_json()
    assert health["sandbox"].startswith("unavailable") and "bubblewrap" in health["sandbox"]


@needs_bwrap
@pytest.mark.slow
def test_healthz_and_doctor_say_which_sandbox_is_in_force(api, migrated):
    from lora_worker.host.nvml import FakeNvml
    from lora_worker.ops.doctor import run_checks

    assert api.get("/healthz").get_json()["sandbox"].startswith("bwrap (")
    assert migrated.nvml_fake_file is not None
    lines = [c.line() for c in run_checks(migrated, FakeNvml.from_file(migrated.nvml_fake_file))]
    assert any(line.startswith("[  ok] sandbox: bwrap (") for line in lines), lines
    loose = migrated.with_overrides(sandbox="none")
    lines = [c.line() for c in run_checks(loose, FakeNvml.from_file(migrated.nvml_fake_file))]
    assert any(line.startswith("[  ok] sandbox: none") for line in lines), lines


def test_the_deployed_unit_requires_the_sandbox_whatever_the_config_file_says():
    from lora_worker.config import REPO_ROOT

    unit = (REPO_ROOT / "systemd" / "lora-worker.service.in").read_text()  # the template install.py fills in
    lines = [line.strip() for line in unit.splitlines() if not line.lstrip().startswith("#")]
    assert "Environment=LORA_WORKER_SANDBOX=bwrap" in lines
    # bwrap makes its namespaces as the service's unprivileged user: the unit must not forbid them.
    assert not any(line.startswith(("RestrictNamespaces=", "PrivateUsers=")) for line in lines)


def test_a_launcher_killed_by_a_signal_reads_as_killed_through_bwrap():
    assert sandbox.wait_status(137, Settings(sandbox="bwrap")) == -9  # bwrap: 128 + SIGKILL
    assert sandbox.wait_status(1, Settings(sandbox="bwrap")) == 1
    assert sandbox.wait_status(-15, Settings(sandbox="bwrap")) == -15  # bwrap itself terminated
    assert sandbox.wait_status(137, Settings(sandbox="none")) == 137


@needs_bwrap
@pytest.mark.slow
def test_doctor_finds_a_bwrap_that_cannot_make_its_namespaces(migrated, monkeypatch, tmp_path):
    from lora_worker.host.nvml import FakeNvml
    from lora_worker.ops.doctor import run_checks

    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap_executable", lambda: str(broken))
    assert migrated.nvml_fake_file is not None
    (check,) = [c for c in run_checks(migrated.with_overrides(sandbox="bwrap"),
                                      FakeNvml.from_file(migrated.nvml_fake_file)) if c.name == "sandbox"]
    assert not check.ok and "Permission denied" in check.detail

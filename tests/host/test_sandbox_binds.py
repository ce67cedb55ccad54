"""The sandbox's own binds never open it up: no `/` or system directory bound because a setting points near it,
and a service run as root never gives the trainer the host's root."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lora_worker.config import Settings, load_settings
from lora_worker.errors import ConfigError
from lora_worker.host import sandbox
from tests.helpers import make_host
from tests.helpers.sandbox import hostile_trainer, needs_bwrap, submit, wait_state


@pytest.fixture
def host(tmp_path: Path):
    return make_host(tmp_path, sandbox="bwrap")


# -- at config load ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, value, said", [
    ("accelerate", "/bin/accelerate", "/ is the root directory"),  # one level below `/`: its "venv" is /
    ("accelerate", "/opt/accelerate", "/ is the root directory"),
    ("accelerate", "/etc/bin/accelerate", "/etc is a system directory"),
    ("accelerate", "/home/bin/accelerate", "/home is a system directory"),
    ("sd_scripts_dir", "/var", "/var is a system directory"),
    ("sd_scripts_dir", "/root", "/root is a system directory"),
    ("tokenizer_cache_dir", "/srv/lora", "holds /srv/lora/state"),  # the state dir's parent
    ("tokenizer_cache_dir", "/srv/lora/state/logs", "holds /srv/lora/state/logs"),  # every job's run log
    ("sd_scripts_dir", "/worktank/arbo", "holds /worktank/arbo/train"),  # every train id in view
])
def test_a_setting_that_would_bind_a_system_directory_is_refused_at_load(setting, value, said):
    environ = {"LORA_WORKER_STATE_DIR": "/srv/lora/state", "LORA_WORKER_TRAIN_ROOT": "/worktank/arbo/train",
               f"LORA_WORKER_{setting.upper()}": value}
    with pytest.raises(ConfigError, match=setting) as refused:
        load_settings(environ)
    assert said in str(refused.value) and "opens it up" in str(refused.value)
    load_settings({**environ, "LORA_WORKER_SANDBOX": "none"})  # nothing is bound without the sandbox


def test_a_link_to_the_root_is_refused_by_what_it_resolves_to(tmp_path):
    (tmp_path / "fluxgym").symlink_to("/")
    with pytest.raises(ConfigError, match="resolves to /"):
        Settings(sd_scripts_dir=tmp_path / "fluxgym")


def test_the_deployed_layout_a_system_wide_launcher_and_the_demos_are_accepted():
    Settings()  # /opt/fluxgym/.venv, sd-scripts, tokenizers
    Settings(accelerate=Path("/usr/local/bin/accelerate"))  # /usr/local: in the sandbox read-only already
    demo = Path("/tmp/lora-worker-demo")  # the demo's state dir holds its trainer, beside the ledger
    Settings(state_dir=demo, accelerate=demo / "trainer/venv/bin/accelerate", sd_scripts_dir=demo / "trainer/sd",
             tokenizer_cache_dir=demo / "trainer/tokenizers")


# -- at dispatch and in doctor: the launcher's interpreter --------------------------------------------------------

def test_an_interpreter_whose_prefix_is_the_root_makes_post_train_a_503_and_doctor_fail(api, host, launches,
                                                                                      migrated):
    from lora_worker.host.nvml import FakeNvml
    from lora_worker.ops.doctor import run_checks

    launcher = migrated.accelerate
    body = launcher.read_text().split("\n", 1)[1]
    launcher.write_text("#!/srv/python3\n" + body)  # /srv/python3: its installation prefix would be /
    response = api.post("/train", json=host.payload())
    assert response.status_code == 503, response.get_json()
    error = response.get_json()
    assert error["error"] == "sandbox_unavailable" and "/ is the root directory" in error["message"], error
    assert launches == []
    (check,) = [c for c in run_checks(migrated, FakeNvml.from_file(migrated.nvml_fake_file)) if c.name == "sandbox"]
    assert not check.ok and "/ is the root directory" in check.detail


def test_the_command_itself_refuses_a_bind_too_wide():
    facts = sandbox.HostFacts(bwrap="/usr/bin/bwrap", interpreter_dirs=(Path("/"),), device_nodes=(),
                              usr_aliases=(), etc_files=(), sys_parts=())
    job = sandbox.JobPaths(Path("/train/7/dataset"), Path("/models/m.safetensors"), Path("/train/7/output"))
    with pytest.raises(ValueError, match="root directory"):
        sandbox.wrap(["x"], job, Settings(), facts, {job.dataset_dir: 3, job.output_dir: 4})


# -- never the host's root ----------------------------------------------------------------------------------------

def test_run_as_root_the_command_makes_a_user_namespace_with_an_unprivileged_uid():
    facts = sandbox.HostFacts(bwrap="/usr/bin/bwrap", interpreter_dirs=(), device_nodes=(), usr_aliases=(),
                              etc_files=(), sys_parts=(), as_root=True)
    job = sandbox.JobPaths(Path("/train/7/dataset"), Path("/models/m.safetensors"), Path("/train/7/output"))
    cmd = sandbox.wrap(["x"], job, Settings(), facts, {job.dataset_dir: 3, job.output_dir: 4})
    head = cmd[:cmd.index("--")]
    assert "--unshare-user" in head and head[head.index("--uid") + 1] == "65534" != "0"
    assert head[head.index("--gid") + 1] == "65534"


@needs_bwrap
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the service runs as root only where the tests do (CI)")
def test_a_trainer_started_by_root_is_not_root_and_cannot_write_proc_sys(client, host):
    report = host.dataset.parent / "output" / "whoami.json"
    hostile_trainer(host, """
        found = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid()}
        found["cap_eff"] = [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")][0]
        try:  # the sandbox's own UTS namespace: harmless to the host even where it works
            with open("/proc/sys/kernel/hostname", "w") as fh:
                fh.write("sandboxed")
            found["proc_sys"] = "written"
        except OSError as exc:
            found["proc_sys"] = repr(exc)
        with open(os.path.join(args["output_dir"], "whoami.json"), "w") as fh:
            json.dump(found, fh)
        sys.exit(1)
    """)
    done = wait_state(client, submit(client, host))
    assert report.exists(), done["error"]
    found = json.loads(report.read_text())
    assert found["uid"] != 0 and found["euid"] != 0 and found["gid"] != 0, found
    assert int(found["cap_eff"], 16) == 0, found
    assert found["proc_sys"] != "written", found


@pytest.mark.slow
@needs_bwrap
def test_doctor_and_healthz_say_that_a_trainer_started_by_root_is_uid_65534(migrated, monkeypatch):
    from lora_worker.host.nvml import FakeNvml
    from lora_worker.ops.doctor import run_checks

    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    (check,) = [c for c in run_checks(migrated, FakeNvml.from_file(migrated.nvml_fake_file)) if c.name == "sandbox"]
    assert check.ok and "run as root: the trainer is uid 65534 in a user namespace" in check.detail, check.detail

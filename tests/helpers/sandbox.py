"""Jobs under the real bubblewrap sandbox: what the sandbox tests share."""
from __future__ import annotations

import textwrap

import pytest

from lora_worker.host import sandbox
from lora_worker.states import TERMINAL_STATES
from tests.helpers import wait_for

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_executable() is None,
                                reason="bubblewrap is not installed (apt-get install bubblewrap)")
TERMINAL = {s.value for s in TERMINAL_STATES}


def submit(client, host, **overrides) -> int:
    response = client.post("/train", json=host.payload(**overrides))
    assert response.status_code == 202, response.get_json()
    return response.get_json()["worker_job_id"]


def wait_state(client, job_id: int, timeout: float = 30) -> dict:
    return wait_for(lambda: (j := client.get(f"/train/{job_id}").get_json())["status"] in TERMINAL and j,
                    timeout=timeout, what=f"job {job_id} to end")


def hostile_trainer(host, body: str) -> None:
    """Replace the fake sd-scripts trainer by `body` (run by the fake accelerate with the job's argv)."""
    script = "import json, os, sys\nargs = dict(a[2:].split('=', 1) for a in sys.argv[1:] if '=' in a)\n"
    (host.sd_scripts / "sdxl_train_network.py").write_text(script + textwrap.dedent(body))

"""A job through the app and its real supervisor: submit, wait for a state or phase, read the trainer's record."""
from __future__ import annotations

import json
from pathlib import Path

from lora_worker.states import TERMINAL_STATES
from tests.helpers import pid_alive, set_modes, wait_for

TERMINAL = {s.value for s in TERMINAL_STATES}


def submit(client, host, **overrides) -> int:
    response = client.post("/train", json=host.payload(**overrides))
    assert response.status_code == 202, response.get_json()
    return response.get_json()["worker_job_id"]


def job(client, job_id: int) -> dict:
    return client.get(f"/train/{job_id}").get_json()


def wait_state(client, job_id: int, *states: str, timeout: float = 30) -> dict:
    return wait_for(lambda: (j := job(client, job_id))["status"] in states and j, timeout=timeout,
                    what=f"job {job_id} in {states}")


def wait_states_removed(output_dir: Path, timeout: float = 10) -> None:
    """The states of an end no resume can follow (a success, a cancel, a failure that would recur) go just after the
    end is written (the outcome first, then the best-effort cleanup: transcript/ending.py), so a poll can see the
    end a moment before they are gone."""
    wait_for(lambda: not [p.name for p in output_dir.iterdir() if p.name.endswith("-state")], timeout=timeout,
             what=f"the states in {output_dir} removed after the end")


def wait_phase(client, job_id: int, phase: str) -> dict:
    return wait_for(lambda: (j := job(client, job_id))["phase"] == phase and j, what=f"phase {phase}")


def recorded(host) -> dict:
    path = host.root / "record.json"
    return wait_for(lambda: path.exists() and json.loads(path.read_text()), what="trainer record")


def modes(host, **values) -> None:
    set_modes(host.sd_scripts, record=str(host.root / "record.json"), **values)


def job_processes(rec: dict) -> list[int]:
    pids = [rec["pgid"], rec["pid"]] + ([rec["grandchild"]] if rec.get("grandchild") else [])
    return [p for p in pids if pid_alive(p)]


"""A job through the app and its real supervisor: submit, wait for a state or phase, read the trainer's record."""
from __future__ import annotations

import json

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


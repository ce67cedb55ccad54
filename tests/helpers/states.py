"""Saved trainer states for tests, shaped as accelerate 1.6 writes them for sd-scripts (host/train_state.py), and
a job that a resume can follow: accepted through the real dispatch path, its run cut off, its states on disk."""
from __future__ import annotations

import json
import sqlite3
import struct
import zipfile
from pathlib import Path

from lora_worker.host.train_state import ARCHIVES, state_name
from lora_worker.ledger import repository as repo
from lora_worker.states import FailureClass, JobState
from lora_worker.transcript.logfile import log_paths
from tests.helpers import write_safetensors

LORA_MODULES = ("lora_unet_down_blocks_1_attentions_0_proj_in", "lora_unet_mid_block_attentions_0_proj_out")


def lora_tensors(rank: int) -> dict[str, tuple[str, list[int]]]:
    tensors: dict[str, tuple[str, list[int]]] = {}
    for module in LORA_MODULES:
        tensors[f"{module}.lora_down.weight"] = ("F32", [rank, 64])
        tensors[f"{module}.lora_up.weight"] = ("F32", [64, rank])
        tensors[f"{module}.alpha"] = ("F32", [])
    return tensors


def write_zip(path: Path, payload: bytes = b"\x80\x02}q\x00." * 64) -> None:
    """A torch.save archive's shape: stored (uncompressed) members under `archive/`."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/version", b"3\n")


def write_state(output_dir: Path, output_name: str, step: int, *, rank: int = 16, epoch: int = 1,
                json_step: int | None = None) -> Path:
    state = output_dir / state_name(output_name, step)
    state.mkdir(parents=True)
    write_safetensors(state / "model.safetensors", lora_tensors(rank), {"format": "pt"})
    for name in ARCHIVES:
        write_zip(state / name)
    (state / "train_state.json").write_text(json.dumps(
        {"current_epoch": epoch, "current_step": step if json_step is None else json_step}))
    return state


def write_step_lora(output_dir: Path, output_name: str, step: int, model_hash: str, rank: int = 16) -> Path:
    path = output_dir / f"{output_name}-step{step:08d}.safetensors"
    write_safetensors(path, lora_tensors(rank), {"ss_new_sd_model_hash": model_hash, "ss_steps": str(step)})
    return path


def log_saves(settings, job_id: int, *steps: int) -> None:
    """The run log's lines of sd-scripts' state saves (train_util.py `saving state at step N`), and the ledger's
    rows of them."""
    head = log_paths(settings.log_dir, job_id)[0]
    head.parent.mkdir(parents=True, exist_ok=True)
    with head.open("a") as fh:
        for step in steps:
            fh.write(f"2026-12-02 10:00:00 INFO saving state at step {step}\n")
    record_states(settings, job_id, *steps)


def interrupted(db, settings, job_id: int, failure: FailureClass | None = FailureClass.HOST_REBOOTED,
                steps: tuple[int, ...] = (2, 4)) -> Path:
    """The accepted job `job_id` failed with `failure` (None: left as it is), having saved a state (and step
    LoRA) at each of `steps`; its output directory."""
    job = repo.get_job(db, job_id)
    if failure is not None:
        assert repo.fail_job(db, job_id, actor="test", failure_class=failure, sentence="cut off")
    output = Path(job.output_dir)
    for step in steps:
        write_step_lora(output, job.output_name, step, "a" * 64, rank=job.lora_rank)
        write_state(output, job.output_name, step, rank=job.lora_rank)
    log_saves(settings, job_id, *steps)
    return output


def record_states(settings, job_id: int, *steps: int) -> None:
    """The `checkpoints` rows the job's progress writes make of its `saving state at step N` lines."""
    conn = sqlite3.connect(settings.database_path)
    with conn:
        output_dir, output_name = conn.execute("SELECT output_dir, output_name FROM jobs WHERE id = ?",
                                               (job_id,)).fetchone()
        output_dir = Path(output_dir)
        conn.executemany("INSERT INTO checkpoints (job_id, kind, step, path, at) VALUES (?, 'state', ?, ?, ?)",
                         [(job_id, step, str(output_dir / f"{output_name}-step{step:08d}-state"),
                           "2026-12-02T10:00:00.000Z") for step in steps])
    conn.close()


ZIP_CENTRAL, ZIP_LOCAL = b"PK\x01\x02", b"PK\x03\x04"


def set_zip_record_field(data: bytes, which: str, field: str, value: int, nth: int = 0) -> bytes:
    """A zip's bytes with the general-purpose flags or the compression method of its `nth` central-directory or
    local record set to `value` (offsets from APPNOTE 4.3.7 and 4.3.12): bit 0 of the flags is "encrypted"."""
    magic, offset = ((ZIP_CENTRAL, {"flags": 8, "method": 10}) if which == "central"
                     else (ZIP_LOCAL, {"flags": 6, "method": 8}))
    starts = [i for i in range(len(data)) if data.startswith(magic, i)]
    out = bytearray(data)
    struct.pack_into("<H", out, starts[nth % len(starts)] + offset[field], value)
    return bytes(out)


def corrupt_archive(state: Path, name: str = "optimizer.bin", field: str = "flags", value: int = 0x1) -> None:
    """One archive of a saved state with one record field changed, in place (a flipped bit, a power cut's)."""
    path = state / name
    path.write_bytes(set_zip_record_field(path.read_bytes(), "central", field, value))


def cut_off_by_a_reboot(client, host, db) -> int:  # type: ignore[no-untyped-def]
    """A running job whose row names another boot, with two states saved: what a power cut leaves."""
    job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
    repo.transition(db, job_id, JobState.RUNNING, actor="test")
    conn = sqlite3.connect(host.settings.database_path)
    with conn:
        conn.execute("UPDATE jobs SET boot_id = 'a-boot-before-this-one' WHERE id = ?", (job_id,))
    conn.close()
    interrupted(db, host.settings, job_id, failure=None)
    return job_id

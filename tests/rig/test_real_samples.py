"""Issue 33 on the REAL trainer, through the worker: the API (Flask test client), the detached supervisor, the
sandbox, and sd-scripts from the CPU rig (LW_RIG_DIR, ../shared/rig). The `fast` tier is shrunk by the test's own
settings (`rig_tier_sizes`: 4 steps at 256 px, rank 4, a step save and a sample pass every 2 steps, 2 sampler
steps; refused in a config file).

A job with two prompts ends `succeeded`; the API lists the images sd-scripts drew before the first step and at steps
2 and 4, each the PNG on disk (its sha256), of the prompts' seeds, tied to the step LoRA of its step (saved right
after the pass, verified), the last one's holding the final LoRA's weights; the contact sheet shows them (steps as
rows, prompts as columns) and is written where LW_RIG_SHEET says (docs/samples-rig-sheet.png was made so); the
sampling phase's share of the run is printed. Opt-in: run alone, `flock /tmp/lw-rig.lock`, with >= 21 GB free.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import struct
from pathlib import Path

import pytest
from PIL import Image

from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from tests.helpers.rig_worker import rig_worker, say
from tests.helpers.runs import wait_state

pytestmark = [pytest.mark.rig, pytest.mark.slow, pytest.mark.timeout(5400)]

RIG = os.environ.get("LW_RIG_DIR")
STEPS, EVERY = 4, 2
PROMPTS = [{"prompt": "photo of ohwx dog", "seed": 42}, {"prompt": "ohwx dog on a beach", "seed": 43}]
PHASE = re.compile(r"phase (\w+)")


@pytest.fixture(scope="module")
def rig_host(tmp_path_factory: pytest.TempPathFactory):
    if not RIG:
        pytest.skip("LW_RIG_DIR is not set: no real trainer rig")
    sizes = {"max_train_steps": STEPS, "network_dim": 4, "resolution": 256, "save_every_n_steps": EVERY,
             "sample_steps": 2}
    with rig_worker(Path(RIG), tmp_path_factory.mktemp("rigsamples"), "rig1", "3_ohwx dog", sizes,
                    samples=PROMPTS) as host:
        yield host


def tensors_sha(path: Path) -> str:
    with path.open("rb") as fh:
        fh.seek(8 + struct.unpack("<Q", fh.read(8))[0])
        return hashlib.sha256(fh.read()).hexdigest()


def phase_times(db: Database, job_id: int) -> dict[str, float]:
    """Seconds spent in each phase, from the job's phase events (when each was entered) to its end."""
    job, events = repo.get_job(db, job_id), repo.job_events(db, job_id)
    marks = [(e.at, m[1]) for e in events if e.reason and (m := PHASE.fullmatch(e.reason))]
    spent: dict[str, float] = {}
    for (at, phase), (until, _) in zip(marks, [*marks[1:], (job.finished_at, "")]):
        spent[phase] = spent.get(phase, 0.0) + (until - at).total_seconds()
    return spent


def test_the_real_trainers_samples_are_listed_each_tied_to_its_step_lora_and_on_the_contact_sheet(rig_host):
    settings, client, db, body = rig_host
    answer = client.post("/train", json=body)
    assert answer.status_code == 202, answer.get_json()
    job_id = answer.get_json()["worker_job_id"]
    say(f"job {job_id}: argv {repo.get_job(db, job_id).argv}")
    done = wait_state(client, job_id, "succeeded", "failed", timeout=5000)
    spent = phase_times(db, job_id)
    wall = (repo.get_job(db, job_id).finished_at - repo.get_job(db, job_id).started_at).total_seconds()
    say(f"job {job_id}: {done['status']} in {wall:.0f} s; per phase {spent}; sampling "
        f"{spent.get('sampling', 0.0) / wall:.0%} of the run")
    assert done["status"] == "succeeded", done
    listing = client.get(f"/train/{job_id}/samples").get_json()
    images, loras = listing["images"], {c["step"]: c for c in done["checkpoints"]}
    for image in images:
        say(f"  {image['name']} step {image['step']} prompt {image['prompt_index']} {image['width']}x"
            f"{image['height']} {image['bytes']} B sha256 {image['sha256'][:12]} lora {image['lora']}")
    assert [(i["step"], i["prompt_index"], i["seed"]) for i in images] == [
        (s, p, PROMPTS[p]["seed"]) for s in (0, 2, 4) for p in (0, 1)]
    folder = Path(done["output_dir"]) / "sample"
    for image in images:
        data = (folder / image["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == image["sha256"] and (image["width"], image["height"]) == (256, 256)
        served = client.get(f"/train/{job_id}/samples/{image['name']}")
        assert served.status_code == 200 and served.data == data
        if image["step"]:
            lora = image["lora"]
            assert (lora["step"], lora["verified"]) == (image["step"], True) and lora["sha256"] == loras[
                image["step"]]["sha256"]
    final = Path(done["lora_path"])
    assert tensors_sha(Path(loras[STEPS]["path"])) == tensors_sha(final)  # the last pass drew the final weights
    sheet = client.get(f"/train/{job_id}/samples.png")
    assert sheet.status_code == 200
    with Image.open(io.BytesIO(sheet.data)) as image:
        image.load()
        say(f"contact sheet: {image.size}, {len(sheet.data)} bytes")
    if target := os.environ.get("LW_RIG_SHEET"):
        Path(target).write_bytes(sheet.data)
        say(f"contact sheet written to {target}")
    assert spent.get("sampling", 0) > 0

"""The sample images through the API (issue 33): a request's prompts bounded and refused by name, every image of a
run listed with its prompt, seed, size, bytes, sha256 and the verified step LoRA of its step, an image served only
as it was listed, the contact sheet, and a verified step LoRA promoted to be the result (idempotent, each refusal
with its reason). The runs are the fake trainer's, under the real supervisor."""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest
from PIL import Image

from lora_worker.errors import PROMOTE_REASONS
from lora_worker.host.images import HEADER_H, LABEL_W, PAD, THUMB
from lora_worker.ledger import repository as repo
from tests.helpers.runs import modes, submit, wait_state

TWO = [{"prompt": "photo of ohwx woman", "seed": 7}, {"prompt": "ohwx woman in a red coat"}]
STEPS = (0, 100, 200, 300, 400)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the request ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("samples, field", [
    ([{"prompt": f"p{i}"} for i in range(5)], "samples"),  # more than MAX_SAMPLE_PROMPTS
    ([{"prompt": "a\nmodel saved."}], "samples.0.prompt"),  # a line of its own in the run log
    ([{"prompt": "a\u2028b"}], "samples.0.prompt"),
    ([{"prompt": ""}], "samples.0.prompt"),
    ([{"prompt": "   "}], "samples.0.prompt"),
    ([{"prompt": "x" * 301}], "samples.0.prompt"),
    ([{"prompt": "ok", "seed": -1}], "samples.0.seed"),
    ([{"prompt": "ok", "seed": "7"}], "samples.0.seed"),
    ([{"prompt": "ok", "sampler": "ddim"}], "samples.0.sampler"),  # the sampler is the worker's constant
    ({"prompt": "ok"}, "samples"),
])
def test_a_prompt_out_of_bounds_is_a_422_naming_it_and_starts_nothing(api, host, launches, samples, field):
    answer = api.post("/train", json=host.payload(samples=samples))
    assert answer.status_code == 422, answer.get_json()
    assert field in answer.get_json()["fields"] and launches == []


def test_no_samples_is_a_command_without_the_sample_flags(api, host, db):
    job_id = submit(api, host, samples=[])
    job = repo.get_job(db, job_id)
    assert job.sample_prompts == [] and not [a for a in job.argv if a.startswith("--sample")]
    assert api.get(f"/train/{job_id}/samples").get_json()["images"] == []


def test_the_prompts_file_is_the_workers_own_and_holds_the_prompts_as_data(api, host, db):
    job_id = submit(api, host, samples=[{"prompt": "ohwx --n ugly --w 4096", "seed": 1}])
    [token] = [a for a in repo.get_job(db, job_id).argv if a.startswith("--sample_prompts=")]
    path = Path(token.split("=", 1)[1])
    assert path.parent == host.settings.state_dir / "prompts" and path.name == sha(path.read_bytes())[:32] + ".json"
    assert path.read_text().count('"width":768') == 1 and '"prompt":"ohwx --n ugly --w 4096"' in path.read_text()


# -- a run's images ---------------------------------------------------------------------------------------------

@pytest.fixture
def ran(client, host):
    """A run of the fast tier with two prompts: a pass before the first step and at 100, 200, 300 and 400."""
    modes(host, step_s=0.002)
    job_id = submit(client, host, samples=TWO)
    done = wait_state(client, job_id, "succeeded", "failed", timeout=60)
    assert done["status"] == "succeeded", done
    return job_id


@pytest.mark.slow
def test_every_image_is_listed_with_its_prompt_size_hash_and_the_step_lora_it_was_drawn_with(client, ran):
    body = client.get(f"/train/{ran}/samples").get_json()
    job = client.get(f"/train/{ran}").get_json()
    loras = {c["step"]: c for c in job["checkpoints"]}
    assert body["prompts"] == [{"prompt": "photo of ohwx woman", "seed": 7},
                               {"prompt": "ohwx woman in a red coat", "seed": 43}]
    assert (body["sample_every_n_steps"], body["sampler"], body["contact_sheet"]) == (
        100, "euler_a", f"/train/{ran}/samples.png")
    images = body["images"]
    assert [(i["step"], i["prompt_index"]) for i in images] == [(s, p) for s in STEPS for p in (0, 1)]
    folder = Path(job["output_dir"]) / "sample"
    for image in images:
        data = (folder / image["name"]).read_bytes()
        assert (image["sha256"], image["bytes"], image["width"], image["height"]) == (sha(data), len(data), 768, 768)
        assert (image["prompt"], image["seed"]) == (body["prompts"][image["prompt_index"]]["prompt"],
                                                    body["prompts"][image["prompt_index"]]["seed"])
        assert image["job_id"] == ran
        if image["step"] == 0:
            assert image["lora"] is None  # the base model's look
        else:
            lora = image["lora"]
            assert (lora["step"], lora["verified"], lora["removed"]) == (image["step"], True, False)
            assert lora["sha256"] == loras[image["step"]]["sha256"] == sha(Path(lora["path"]).read_bytes())


@pytest.mark.slow
def test_an_image_is_served_as_listed_and_refused_once_it_changed(client, ran):
    images = client.get(f"/train/{ran}/samples").get_json()["images"]
    folder = Path(client.get(f"/train/{ran}").get_json()["output_dir"]) / "sample"
    first, second = images[0], images[1]
    served = client.get(f"/train/{ran}/samples/{first['name']}")
    assert served.status_code == 200 and served.mimetype == "image/png" and sha(served.data) == first["sha256"]
    data = bytearray((folder / first["name"]).read_bytes())
    data[-20] ^= 0xFF  # the same size, other bytes
    (folder / first["name"]).write_bytes(bytes(data))
    os.replace(folder / second["name"], folder / "elsewhere.png")
    (folder / second["name"]).symlink_to(folder / "elsewhere.png")  # the same bytes, through a link
    for name in (first["name"], second["name"]):
        gone = client.get(f"/train/{ran}/samples/{name}")
        assert gone.status_code == 410 and gone.get_json()["error"] == "sample_gone"
    for name in ("elsewhere.png", "nothing.png"):
        missing = client.get(f"/train/{ran}/samples/{name}")
        assert missing.status_code == 404 and missing.get_json()["error"] == "sample_not_found"
    assert client.get(f"/train/{ran + 99}/samples/{first['name']}").get_json()["error"] == "job_not_found"


@pytest.mark.slow
def test_the_contact_sheet_has_the_steps_as_rows_and_the_prompts_as_columns(client, ran):
    sheet = client.get(f"/train/{ran}/samples.png")
    assert sheet.status_code == 200 and sheet.mimetype == "image/png"
    with Image.open(io.BytesIO(sheet.data)) as image:
        image.load()
        assert image.size == (LABEL_W + 2 * (THUMB + PAD) + PAD, HEADER_H + len(STEPS) * (THUMB + PAD) + PAD)
        # each cell holds its thumbnail: the fake's images are gradients, never the sheet's white
        for row in range(len(STEPS)):
            for column in range(2):
                x, y = LABEL_W + column * (THUMB + PAD) + PAD + THUMB // 2, HEADER_H + row * (THUMB + PAD) + 10
                assert image.getpixel((x, y)) != (255, 255, 255), (row, column)


def test_a_job_without_images_has_no_sheet(api, host):
    job_id = submit(api, host)
    answer = api.get(f"/train/{job_id}/samples.png")
    assert answer.status_code == 404 and answer.get_json()["error"] == "sample_not_found"


# -- choosing a step -------------------------------------------------------------------------------------------

def refused(client, job_id: int, step: int, reason: str) -> None:
    answer = client.post(f"/train/{job_id}/promote", json={"step": step})
    body = answer.get_json()
    assert answer.status_code == 422 and body["error"] == "not_promotable", body
    assert body["details"]["reason"] == reason and PROMOTE_REASONS[reason] in body["message"]


@pytest.mark.slow
def test_a_verified_step_lora_becomes_the_result_once_without_training_again(client, db, ran):
    before = client.get(f"/train/{ran}").get_json()
    step_200 = next(c for c in before["checkpoints"] if c["step"] == 200)
    answer = client.post(f"/train/{ran}/promote", json={"step": 200})
    assert answer.status_code == 200, answer.get_json()
    assert answer.get_json() == {"worker_job_id": ran, "promoted_step": 200, "lora_path": step_200["path"],
                                 "lora_sha256": step_200["sha256"], "lora_size": step_200["bytes"], "changed": True}
    after = client.get(f"/train/{ran}").get_json()
    assert (after["status"], after["lora_path"], after["lora_sha256"], after["promoted_step"]) == (
        "succeeded", step_200["path"], step_200["sha256"], 200)
    assert Path(before["lora_path"]).exists()  # the final LoRA is still there, no longer the result
    again = client.post(f"/train/{ran}/promote", json={"step": 200})
    assert again.status_code == 200 and again.get_json()["changed"] is False
    assert [e.reason for e in repo.job_events(db, ran) if "promoted" in (e.reason or "")] == [
        f"promoted the step LoRA of step 200 to the result: {step_200['path']}"]
    assert client.get(f"/train/{ran}/samples").get_json()["promoted_step"] == 200


@pytest.mark.slow
def test_a_step_without_a_verified_step_lora_as_it_was_verified_is_refused_with_its_reason(client, ran):
    refused(client, ran, 250, "no_step_lora")
    step_300 = Path(next(c for c in client.get(f"/train/{ran}").get_json()["checkpoints"] if c["step"] == 300)["path"])
    with step_300.open("ab") as fh:
        fh.write(b"\0")
    refused(client, ran, 300, "file_changed")
    step_300.unlink()
    refused(client, ran, 300, "file_changed")
    assert client.get(f"/train/{ran}").get_json()["promoted_step"] is None


@pytest.mark.slow
def test_an_unverified_or_a_pruned_step_lora_is_refused(client, host):
    modes(host, step_s=0.002, step_metadata_overrides={"ss_steps": "7"})
    unverified = submit(client, host)
    assert wait_state(client, unverified, "succeeded", "failed", timeout=60)["status"] == "succeeded"
    refused(client, unverified, 200, "not_verified")
    modes(host, step_s=0.002)
    pruned = submit(client, host, samples=[], output_name="ohwx_plain")  # one step LoRA kept: the newest
    assert wait_state(client, pruned, "succeeded", "failed", timeout=60)["status"] == "succeeded"
    refused(client, pruned, 100, "removed")
    assert client.post(f"/train/{pruned}/promote", json={"step": 400}).status_code == 200


def test_a_job_that_has_not_succeeded_has_no_result_to_replace(api, running_job):
    refused(api, running_job, 100, "job_not_succeeded")


def test_a_promote_body_out_of_bounds_is_a_422_and_an_unknown_job_a_404(api, host):
    job_id = submit(api, host)
    for body in ({}, {"step": "200"}, {"step": 0}, {"step": 200, "extra": 1}):
        answer = api.post(f"/train/{job_id}/promote", json=body)
        assert answer.status_code == 422 and answer.get_json()["error"] == "validation_failed", body
    assert api.post("/train/4242/promote", json={"step": 100}).get_json()["error"] == "job_not_found"

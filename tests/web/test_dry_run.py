"""POST /train?dry_run=1 (issue 34): every check a real POST makes, the same refusals, nothing started or written,
and 200 with the plan; the lint's errors are a 422 on both, its warnings ride the plan, the 202 and the job."""
from __future__ import annotations

import io
import json
import os
import sqlite3
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from lora_worker import create_app
from lora_worker.ledger.migrate import migrate
from tests.helpers import Launches, job_rows, png_bytes

FOLDER = "10_ohwx woman"


def ledger_counts(settings) -> dict[str, int]:
    conn = sqlite3.connect(settings.database_path)
    try:
        return {table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                for table in ("jobs", "job_events", "webhook_events")}
    finally:
        conn.close()


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def webhook_api(host, monkeypatch):
    """An app with a webhook target configured (so a real POST writes job.queued to the outbox) and a recording
    launcher; each sender the web would start (at start-up, after a dispatch) is recorded instead."""
    senders: list[object] = []
    for where in ("lora_worker.web.app", "lora_worker.web.service"):
        monkeypatch.setattr(f"{where}.ensure_sender", senders.append)
    settings = replace(host.settings, webhook_url="http://127.0.0.1:9/hook")
    migrate(settings)
    launches = Launches()
    app = create_app(settings, launch=launches)
    app.config["TESTING"] = True
    senders.clear()  # the one the start-up asks for
    yield app.test_client(), settings, launches, senders
    app.extensions["lora_worker"].db.dispose()


def test_a_dry_run_answers_the_plan_and_changes_nothing(webhook_api, host):
    api, settings, launches, senders = webhook_api
    before_ledger, before_state = ledger_counts(settings), tree(settings.state_dir)
    before_train = tree(host.root / "train")
    answer = api.post("/train?dry_run=1", json=host.payload(), headers={"Idempotency-Key": "k-1"})
    assert answer.status_code == 200, answer.get_json()
    plan = answer.get_json()
    # nothing written, created, launched or sent
    assert ledger_counts(settings) == before_ledger and tree(settings.state_dir) == before_state
    assert tree(host.root / "train") == before_train and not Path(host.payload()["output_dir"]).exists()
    assert launches == [] and senders == []
    # the same request for real: a new job (the key was not kept), whose argv is the plan's, with the plan's warnings
    accepted = api.post("/train", json=host.payload(), headers={"Idempotency-Key": "k-1"})
    assert accepted.status_code == 202 and launches == [accepted.get_json()["worker_job_id"]] and len(senders) == 1
    job = api.get(f"/train/{accepted.get_json()['worker_job_id']}").get_json()
    conn = sqlite3.connect(settings.database_path)
    argv = conn.execute("SELECT argv FROM jobs").fetchone()[0]
    conn.close()
    assert plan["argv"] == json.loads(argv)
    # and the dataset config it names is the one the real POST wrote, byte for byte (the dry run wrote none)
    config = plan["dataset"]["dataset_config"]
    assert f"--dataset_config={config['path']}" in plan["argv"]
    assert Path(config["path"]).read_bytes() == config["toml"].encode()
    # and the prompts file it names too (the default prompt), in the state dir the dry run left as it was
    prompts = next(a.split("=", 1)[1] for a in plan["argv"] if a.startswith("--sample_prompts="))
    assert Path(prompts).parent == settings.state_dir / "prompts" and json.loads(Path(prompts).read_bytes())
    assert plan["lint"]["warnings"] == accepted.get_json()["warnings"] == job["warnings"]
    assert ledger_counts(settings)["webhook_events"] == 1


def test_the_plan_says_the_counts_the_buckets_the_states_the_time_and_the_disk(api, host):
    plan = api.post("/train?dry_run=1", json=host.payload()).get_json()
    data = plan["dataset"]
    # three 64 px images in `10_ohwx woman`, the fast tier on the 48 GB card (batch 2), a state every 100 steps:
    # sd-scripts is shown the smallest repeats for which one epoch holds the 400 steps, ceil(400 × 2 / 3) = 267
    assert (data["images"], data["folder_repeats"], data["repeats"], data["images_x_repeats"],
            data["batch_size"]) == (3, 10, 267, 801, 2)
    assert (data["steps_per_epoch"], data["epochs"], data["max_train_steps"]) == (401, 1, 400)
    # the state at step 400 is the last step's: nothing is left to train from it (state_at_last_step)
    assert data["states"] == [{"step": s, "resumable": s < 400} for s in (100, 200, 300, 400)]
    assert data["bucket_table"]["lines"] == ["bucket 0: resolution (64, 64), count: 801",
                                             "mean ar error (without repeats): 0.0"]
    assert tomllib.loads(data["dataset_config"]["toml"]) == {"datasets": [{"subsets": [{
        "image_dir": str(host.dataset / FOLDER), "class_tokens": "ohwx woman", "num_repeats": 267}]}]}
    assert plan["estimated_duration"] == {"seconds": 70 * 60.0, "basis": "tier_bound", "jobs": 0}
    # the default sample prompt: the 4 sampled step LoRAs kept (one more while a save runs) and 5 images of 2 MiB
    assert plan["disk_mib_at_peak"] == 1024 + 2 * 257 + 5 * 85 + 5 * 2
    assert {w["code"] for w in plan["lint"]["warnings"]} == {"image_small", "image_duplicate"}
    assert plan["lint"]["images_decoded"] == 3 and plan["dry_run"] is True


def test_the_plans_argv_draws_the_samples_and_its_disk_counts_the_step_loras_they_keep(api, host):
    drawn = api.post("/train?dry_run=1", json={**host.payload(), "samples": [{"prompt": "ohwx dog", "seed": 7}] * 2})
    plan = drawn.get_json()
    flags = [a for a in plan["argv"] if a.startswith("--sample")]
    assert [f.split("=")[0] for f in flags] == ["--sample_prompts", "--sample_every_n_steps", "--sample_sampler",
                                                "--sample_at_first"]
    assert "--sample_every_n_steps=100" in flags and "--sample_sampler=euler_a" in flags
    assert "--save_last_n_steps=301" in plan["argv"]  # the 4 sampled step LoRAs kept
    assert plan["disk_mib_at_peak"] == 1024 + 2 * 257 + 5 * 85 + 10 * 2  # 5 passes of 2 prompts
    none = api.post("/train?dry_run=1", json={**host.payload(), "samples": []}).get_json()
    assert not [a for a in none["argv"] if a.startswith("--sample")] and "--save_last_n_steps=1" in none["argv"]
    assert none["disk_mib_at_peak"] == 1024 + 2 * 257 + 2 * 85


def test_with_many_images_fewer_repeats_make_the_one_epoch(api, host):
    for i in range(3, 50):
        (host.dataset / FOLDER / f"img{i}.png").write_bytes(png_bytes(64 + i, 64))
    data = api.post("/train?dry_run=1", json=host.payload()).get_json()["dataset"]
    assert (data["repeats"], data["images_x_repeats"], data["epochs"]) == (16, 800, 1)
    assert data["steps_per_epoch"] >= 400 and [s["step"] for s in data["states"] if s["resumable"]] == [100, 200, 300]


def truncated_png() -> bytes:
    out = io.BytesIO()
    Image.effect_noise((300, 300), 50).convert("RGB").save(out, "PNG")
    return out.getvalue()[:5000]


@pytest.mark.parametrize("path", ["/train?dry_run=1", "/train"])
def test_a_lint_error_is_a_422_naming_the_file_and_the_code_on_a_dry_run_and_a_real_post(api, host, path):
    (host.dataset / FOLDER / "img1.png").write_bytes(truncated_png())
    (host.dataset / FOLDER / "img2.txt").write_bytes(b"\xff\xfe not utf-8")
    answer = api.post(path, json=host.payload())
    body = answer.get_json()
    assert answer.status_code == 422 and body["error"] == "dataset_invalid", body
    assert {(f["code"], f["file"]) for f in body["details"]["findings"]} == {
        ("caption_not_utf8", f"{FOLDER}/img2.txt")}  # the dataset's own checks first: nothing is decoded yet
    (host.dataset / FOLDER / "img2.txt").write_text("ohwx woman\n")
    body = api.post(path, json=host.payload()).get_json()
    errors = [(f["code"], f["file"]) for f in body["details"]["findings"] if f["severity"] == "error"]
    assert errors == [("image_undecodable", f"{FOLDER}/img1.png")] and "img1.png" in body["fields"]["dataset_dir"][0]
    assert job_rows(host.settings) == 0


@pytest.mark.parametrize("path", ["/train?dry_run=1", "/train"])
def test_an_empty_caption_and_no_images_are_422s_with_their_codes(api, host, path):
    (host.dataset / FOLDER / "img0.txt").write_bytes(b"")
    body = api.post(path, json=host.payload()).get_json()
    assert [f["code"] for f in body["details"]["findings"]] == ["caption_empty"]
    for name in os.listdir(host.dataset / FOLDER):
        os.unlink(host.dataset / FOLDER / name)
    body = api.post(path, json=host.payload()).get_json()
    assert [(f["code"], f["file"]) for f in body["details"]["findings"]] == [("no_images", FOLDER)]


def test_a_dry_run_is_refused_as_a_real_post_is_while_a_job_is_active(api, host):
    assert api.post("/train", json=host.payload()).status_code == 202
    answer = api.post("/train?dry_run=1", json=host.payload(output_name="other"))
    assert answer.status_code == 409 and answer.get_json()["error"] == "job_active"


def test_a_misspelt_dry_run_starts_nothing(api, host, launches):
    answer = api.post("/train?dryrun=1", json=host.payload())
    assert answer.status_code == 422 and "dryrun" in answer.get_json()["fields"]
    assert launches == [] and job_rows(host.settings) == 0
    assert api.post("/train?dry_run=0", json=host.payload()).status_code == 202

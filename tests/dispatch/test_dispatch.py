"""POST /train: everything is validated before anything is written; every refusal is a JSON 4xx/503."""
from __future__ import annotations

import json
import os
import sqlite3
import tomllib
import unicodedata

import pytest

from tests.helpers import job_rows as rows, make_dataset, write_safetensors
from tests.helpers.api import assert_refused


def test_valid_request_is_accepted_recorded_and_launched(api, host, launches):
    response = api.post("/train", json=host.payload())
    assert response.status_code == 202
    job_id = response.get_json()["worker_job_id"]
    assert launches == [job_id]
    job = api.get(f"/train/{job_id}").get_json()
    assert (job["status"], job["tier"], job["device_index"], job["step"], job["total_steps"]) == (
        "queued", "fast", 1, 0, 400)
    assert job["image_count"] == 3 and job["train_id"] == "t1"
    assert (host.dataset.parent / "output").is_dir()


def test_the_resolved_real_paths_are_what_the_trainer_receives(api, host):
    link = host.root / "train" / "t1" / "data-link"
    link.symlink_to(host.dataset)
    job_id = api.post("/train", json=host.payload(dataset_dir=str(link))).get_json()["worker_job_id"]
    conn = sqlite3.connect(host.settings.database_path)
    (argv,) = conn.execute("SELECT argv FROM jobs WHERE id=?", (job_id,)).fetchone()
    conn.close()
    (config,) = [a.split("=", 1)[1] for a in json.loads(argv) if a.startswith("--dataset_config=")]
    assert "--train_data_dir" not in argv
    with open(config, "rb") as fh:
        written = tomllib.load(fh)
    assert written["datasets"][0]["subsets"][0]["image_dir"] == str(
        host.dataset / "10_ohwx woman")


def test_the_row_records_the_resolved_request_and_the_lora_it_must_produce(api, host):
    data_link, out_link = host.root / "train" / "t1" / "data-link", host.root / "train" / "t1" / "out-link"
    data_link.symlink_to(host.dataset)
    (host.dataset.parent / "output").mkdir()
    out_link.symlink_to(host.dataset.parent / "output")
    body = host.payload(dataset_dir=str(data_link), output_dir=str(out_link / "run1"), tier="balanced", seed=7)
    job_id = api.post("/train", json=body).get_json()["worker_job_id"]
    conn = sqlite3.connect(host.settings.database_path)
    conn.row_factory = sqlite3.Row
    row = conn.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
    conn.close()
    real_out = host.dataset.parent / "output" / "run1"
    assert (row["dataset_dir"], row["output_dir"], row["train_id"]) == (str(host.dataset), str(real_out), "t1")
    assert (row["lora_file"], row["lora_rank"], row["lora_steps"], row["lora_dtype"]) == (
        str(real_out / "ohwx_lora.safetensors"), 32, 1500, "F16")
    assert (row["output_name"], row["seed"], row["total_steps"]) == ("ohwx_lora", 7, 1500)
    argv = json.loads(row["argv"])
    assert f"--output_dir={real_out}" in argv and "--network_dim=32" in argv and "--max_train_steps=1500" in argv


def test_a_dangling_link_where_the_lora_goes_is_output_exists(api, host, launches):
    out = host.dataset.parent / "output"
    out.mkdir()
    (out / "ohwx_lora.safetensors").symlink_to(host.root / "elsewhere.safetensors")  # sd-scripts would follow it
    assert_refused(api.post("/train", json=host.payload()), 422, "output_exists", host.settings, launches)
    assert not (host.root / "elsewhere.safetensors").exists()


@pytest.mark.parametrize("field, value", [
    ("tier", "ultra"), ("tier", 3), ("tier", None),
    ("repeats", 0), ("repeats", 101), ("repeats", 2.5), ("repeats", "10"), ("repeats", True),
    ("seed", -1), ("seed", 2**31), ("seed", 1e30), ("seed", "42"),
    ("device_index", -1), ("device_index", 64), ("device_index", "1"),
    ("output_name", ""), ("output_name", "../x"), ("output_name", "a/b"), ("output_name", "-rf"),
    ("output_name", ".hidden"), ("output_name", "x" * 65), ("output_name", "name\n"), ("output_name", "naïve"),
    ("trigger", "oh wx"), ("trigger", "--config_file=/x"), ("trigger", ""), ("trigger", "ohwx\x00"),
    ("subject_class", "woman  x"), ("subject_class", " woman"), ("subject_class", "a/b"), ("subject_class", "x" * 49),
    ("max_grad_norm", -0.1), ("max_grad_norm", 11), ("max_grad_norm", "nan"),
    ("lora_target_modules", "attn_only"), ("lora_target_modules", "conv_dim=64"),
    ("dataset_dir", "relative/path"), ("dataset_dir", "/train/../etc"), ("dataset_dir", "/a/\x00b"),
    ("dataset_dir", "/a/\nb"), ("dataset_dir", unicodedata.normalize("NFD", "/café")), ("dataset_dir", ""),
    ("dataset_dir", 7), ("base_model_path", "/x/" + "y" * 5000),
])
def test_out_of_bounds_fields_are_a_422_naming_the_field(api, host, launches, field, value):
    response = api.post("/train", json=host.payload(**{field: value}))
    assert_refused(response, 422, "validation_failed", host.settings, launches, field)


@pytest.mark.parametrize("missing", ["dataset_dir", "base_model_path", "output_dir", "output_name", "trigger",
                                     "subject_class", "repeats", "tier", "device_index", "seed"])
def test_every_contract_field_is_required(api, host, launches, missing):
    body = host.payload()
    del body[missing]
    assert_refused(api.post("/train", json=body), 422, "validation_failed", host.settings, launches, missing)


def test_unknown_fields_are_refused(api, host, launches):
    response = api.post("/train", json=host.payload(learning_rate=1.0))
    assert_refused(response, 422, "validation_failed", host.settings, launches, "learning_rate")


def test_quality_on_the_lean_card_is_a_422_not_a_downgrade(api, host, launches):
    response = api.post("/train", json=host.payload(tier="quality", device_index=0))
    body = assert_refused(response, 422, "validation_failed", host.settings, launches, "tier")
    assert "device 0" in body["fields"]["tier"][0]


def test_an_unconfigured_device_is_a_422(api, host, launches):
    response = api.post("/train", json=host.payload(device_index=5))
    assert_refused(response, 422, "validation_failed", host.settings, launches, "device_index")


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "bad_request"),
    (b"[1, 2]", 422, "validation_failed"),
    (b'"a string"', 422, "validation_failed"),
    (b"", 400, "bad_request"),
    (b"[" * 20_000 + b"]" * 20_000, 400, "bad_request"),  # under the size limit, past the parser's recursion
])
def test_malformed_bodies(api, host, launches, body, status, code):
    response = api.post("/train", data=body, content_type="application/json")
    assert_refused(response, status, code, host.settings, launches)


def test_a_body_over_64_kib_is_a_413(api, host, launches):
    response = api.post("/train", data=b'{"x": "' + b"a" * 70_000 + b'"}', content_type="application/json")
    assert_refused(response, 413, "request_entity_too_large", host.settings, launches)


def test_a_second_job_while_one_is_active_is_a_409_naming_it(api, host, launches):
    first = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    response = api.post("/train", json=host.payload(output_name="second"))
    body = response.get_json()
    assert response.status_code == 409 and body["error"] == "job_active"
    assert body["details"]["active_job_id"] == first and str(first) in body["message"]
    assert launches == [first] and rows(host.settings) == 1


def test_a_missing_trainer_is_a_503_naming_the_path(api, host, launches):
    host.settings.accelerate.unlink()
    response = api.post("/train", json=host.payload())
    body = assert_refused(response, 503, "trainer_unavailable", host.settings, launches)
    assert str(host.settings.accelerate) in body["message"]
    assert str(host.settings.accelerate) in " ".join(body["details"]["missing"])


@pytest.mark.own_tokenizers  # it breaks its host's tokenizers
def test_missing_tokenizers_are_a_503(api, host, launches):
    (host.settings.tokenizer_cache_dir / "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k" / "vocab.json").unlink()
    body = assert_refused(api.post("/train", json=host.payload()), 503, "trainer_unavailable", host.settings,
                          launches)
    assert "laion_CLIP-ViT-bigG" in body["message"]


def test_an_existing_lora_is_never_overwritten_and_is_a_422_on_output_name(api, host, launches):
    out = host.dataset.parent / "output"
    out.mkdir()
    (out / "ohwx_lora.safetensors").write_bytes(b"previous run")
    body = assert_refused(api.post("/train", json=host.payload()), 422, "output_exists", host.settings, launches,
                          "output_name")
    assert body["retryable"] is False  # the file stays: retrying the same request can never succeed


# -- paths -----------------------------------------------------------------------------------------------------

def test_traversal_and_escapes_are_refused(api, host, launches):
    root = host.settings.train_root
    outside = host.root / "outside"
    outside.mkdir()
    (root / "t1" / "escape").symlink_to(outside)
    make_dataset(root, "t10")  # a sibling whose name starts with "t1"
    cases = {
        "dataset_dir": [str(root / "t1" / "escape"), str(outside), "/etc", str(root)],
        "output_dir": [str(root / "t1" / "escape" / "out"), str(root / "t10" / "output"), str(outside / "o"),
                       str(host.dataset / "10_ohwx woman" / "out"), str(root / "t1")],
        "base_model_path": [str(outside / "m.safetensors"), "/etc/passwd", str(host.dataset)],
    }
    write_safetensors(outside / "m.safetensors", {"x": ("F16", [1])})
    for field, values in cases.items():
        for value in values:
            response = api.post("/train", json=host.payload(**{field: value}))
            assert_refused(response, 422, "validation_failed", host.settings, launches, field)
    assert not (outside / "out").exists()


def test_a_model_outside_the_models_dir_or_not_safetensors_is_refused(api, host, launches):
    other = host.settings.model_dirs[0] / "model.ckpt"
    other.write_bytes(b"x")
    assert_refused(api.post("/train", json=host.payload(base_model_path=str(other))), 422, "validation_failed",
                   host.settings, launches, "base_model_path")
    missing = host.settings.model_dirs[0] / "missing.safetensors"
    assert_refused(api.post("/train", json=host.payload(base_model_path=str(missing))), 422, "validation_failed",
                   host.settings, launches, "base_model_path")


def test_a_new_output_dir_name_must_be_safe(api, host, launches):
    out = host.dataset.parent / "out put"
    assert_refused(api.post("/train", json=host.payload(output_dir=str(out))), 422, "validation_failed",
                   host.settings, launches, "output_dir")
    assert not out.exists()


def test_an_output_dir_under_a_file_is_a_422_and_writes_nothing(api, host, launches):
    notes = host.dataset.parent / "notes.txt"
    notes.write_text("not a directory")
    body = assert_refused(api.post("/train", json=host.payload(output_dir=str(notes / "output"))), 422,
                          "validation_failed", host.settings, launches, "output_dir")
    assert "is not one" in body["fields"]["output_dir"][0]


@pytest.mark.parametrize("field", ["dataset_dir", "base_model_path", "output_dir"])
def test_a_lone_surrogate_in_a_path_is_a_422(api, host, launches, field):
    body = json.dumps({**host.payload(), field: "/train/t1/\ud800"}).encode()  # valid JSON, not encodable
    assert_refused(api.post("/train", data=body, content_type="application/json"), 422, "validation_failed",
                   host.settings, launches, field)


def test_max_grad_norm_must_be_a_json_number(api, host, launches):
    assert_refused(api.post("/train", json=host.payload(max_grad_norm="0.5")), 422, "validation_failed",
                   host.settings, launches, "max_grad_norm")
    assert_refused(api.post("/train", json=host.payload(max_grad_norm=True)), 422, "validation_failed",
                   host.settings, launches, "max_grad_norm")


def test_output_dir_is_created_group_writable(api, host):
    os.chmod(host.dataset.parent, 0o2770)
    target = host.dataset.parent / "output" / "run1"
    assert api.post("/train", json=host.payload(output_dir=str(target))).status_code == 202
    mode = target.stat().st_mode
    assert mode & 0o070 == 0o070 and mode & 0o2000 and not mode & 0o007


# -- the dataset -------------------------------------------------------------------------------------------------

def test_the_kohya_folder_must_match_the_request(api, host, launches):
    response = api.post("/train", json=host.payload(repeats=5))
    body = assert_refused(response, 422, "dataset_invalid", host.settings, launches, "dataset_dir")
    assert "'5_ohwx woman'" in body["fields"]["dataset_dir"][0]


def test_a_folder_without_images_is_refused(api, host, launches):
    for f in (host.dataset / "10_ohwx woman").iterdir():
        f.unlink()
    assert_refused(api.post("/train", json=host.payload()), 422, "dataset_invalid", host.settings, launches)


def test_a_dataset_folder_the_worker_cannot_list_is_a_422(api, host, launches, monkeypatch):
    # The sessions run as root, where chmod 000 stops nothing: the refusal is played by the OS call itself.
    real_scandir = os.scandir

    def denied(path):  # type: ignore[no-untyped-def]
        # The dataset is listed through an open descriptor (no path is used twice): name it as the kernel does.
        shown = os.readlink(f"/proc/self/fd/{path}") if isinstance(path, int) else str(path)
        if shown.endswith("10_ohwx woman"):
            raise PermissionError(13, "Permission denied")
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    body = assert_refused(api.post("/train", json=host.payload()), 422, "dataset_invalid", host.settings, launches)
    assert "Permission denied" in body["message"]


def test_other_training_folders_in_the_dataset_are_refused(api, host, launches):
    (host.dataset / "3_other thing").mkdir()
    body = assert_refused(api.post("/train", json=host.payload()), 422, "dataset_invalid", host.settings, launches)
    assert "3_other thing" in body["message"]


@pytest.mark.parametrize("caption, why", [(b"", "empty"), (b"\n\nsecond line", "empty"), (b"\xff\xfe", "UTF-8")])
def test_empty_or_undecodable_captions_are_refused(api, host, launches, caption, why):
    (host.dataset / "10_ohwx woman" / "img1.txt").write_bytes(caption)
    body = assert_refused(api.post("/train", json=host.payload()), 422, "dataset_invalid", host.settings, launches)
    assert "img1.txt" in body["message"] and why in body["message"]


def test_an_image_that_is_not_an_image_is_refused(api, host, launches):
    (host.dataset / "10_ohwx woman" / "img2.png").write_bytes(b"GIF89a not a png")
    body = assert_refused(api.post("/train", json=host.payload()), 422, "dataset_invalid", host.settings, launches)
    assert "img2.png" in body["message"]


def test_images_without_captions_are_fine(api, host):
    for f in (host.dataset / "10_ohwx woman").glob("*.txt"):
        f.unlink()
    assert api.post("/train", json=host.payload()).status_code == 202


def test_a_base_model_that_is_not_sdxl_is_refused(api, host, launches):
    write_safetensors(host.model, {"model.diffusion_model.x": ("F16", [1])})
    body = assert_refused(api.post("/train", json=host.payload()), 422, "base_model_invalid", host.settings,
                          launches, "base_model_path")
    assert "text encoder" in body["fields"]["base_model_path"][0]
    write_safetensors(host.model, {"model.diffusion_model.x": ("F16", [64])}, truncate_by=10)
    assert_refused(api.post("/train", json=host.payload()), 422, "base_model_invalid", host.settings, launches)


# -- reading ---------------------------------------------------------------------------------------------------

def test_unknown_jobs_are_404_json(api):
    for url in ("/train/999", "/train/99999999999999999999999", "/train/999/log", "/train/abc"):
        response = api.get(url)
        assert response.status_code == 404 and response.is_json, url
    response = api.post("/train/999/cancel")
    assert response.status_code == 404 and response.get_json()["error"] == "job_not_found"


def test_wrong_method_is_a_json_405(api):
    response = api.delete("/train")
    assert response.status_code == 405 and response.is_json


def test_job_list_filters_and_pages(api, host, db):
    from lora_worker.ledger import repository as repo
    from lora_worker.states import JobState
    ids = []
    for i in range(5):
        job_id = api.post("/train", json=host.payload(output_name=f"n{i}")).get_json()["worker_job_id"]
        repo.transition(db, job_id, JobState.FAILED if i % 2 else JobState.CANCELLED, actor="test")
        ids.append(job_id)
    page = api.get("/train?limit=2").get_json()
    assert [j["worker_job_id"] for j in page["jobs"]] == ids[::-1][:2]
    rest = api.get(f"/train?limit=10&before_id={page['next_before_id']}").get_json()
    assert [j["worker_job_id"] for j in rest["jobs"]] == ids[::-1][2:] and rest["next_before_id"] is None
    failed = api.get("/train?status=failed").get_json()["jobs"]
    assert [j["worker_job_id"] for j in failed] == [ids[3], ids[1]]
    assert api.get("/train?status=bogus").status_code == 422
    assert api.get("/train?limit=0").status_code == 422

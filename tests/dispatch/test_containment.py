"""The trust boundary with arbo, tried as a hostile uploader would: POST /train follows no link, opens nothing
that blocks, sees every folder sd-scripts would train on, and refuses a LoRA path that holds anything."""
from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sqlite3
import threading
from pathlib import Path

import pytest

from lora_worker.dispatch import paths
from lora_worker.dispatch.dataset import CAPTION_MAX_BYTES
from lora_worker.errors import InvalidRequest
from lora_worker.host import fs
from lora_worker.states import TERMINAL_STATES
from tests.helpers import job_rows as rows, png_bytes, set_modes, wait_for

FOLDER = "10_ohwx woman"
TERMINAL = {s.value for s in TERMINAL_STATES}


def refused(response, settings, launches, status: int = 422, code: str = "dataset_invalid") -> str:
    """Assert a refusal that changed nothing; return its message and field messages as one text."""
    body = response.get_json()
    assert response.status_code == status and body["error"] == code, body
    assert rows(settings) == 0 and launches == []
    return body["message"] + " " + " ".join(m for ms in (body.get("fields") or {}).values() for m in ms)


def post_bounded(api, body: dict, seconds: float = 10.0):
    """POST /train in a thread: a request that blocks fails the test instead of hanging it."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(api.post("/train", json=body)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"POST /train did not answer within {seconds}s"
    return result[0]


def bound_socket(path: Path) -> None:
    """A unix socket's file, left at `path` (the socket itself is closed; its file stays)."""
    # Bound by its name from its folder: a unix socket's path is at most 108 bytes, and an xdist worker's tmp dir
    # is long enough to pass that.
    with socket.socket(socket.AF_UNIX) as sock, contextlib.chdir(path.parent):
        sock.bind(path.name)


@pytest.fixture
def secret(host) -> Path:
    """A file of the service user outside the train root: what a planted link would exfiltrate."""
    path = host.root / "secret.txt"
    path.write_text("api_token=hunter2\n")
    return path


@pytest.fixture
def folder(host) -> Path:
    return host.dataset / FOLDER


# -- links inside the dataset --------------------------------------------------------------------------------

def test_a_symlinked_kohya_folder_is_refused_naming_it(api, host, launches, folder):
    outside = host.root / "elsewhere"
    folder.rename(outside)
    folder.symlink_to(outside)
    text = refused(api.post("/train", json=host.payload()), host.settings, launches)
    assert repr(FOLDER) in text and "symlink" in text


def test_a_symlinked_image_is_refused_naming_it(api, host, launches, folder):
    outside = host.root / "outside.png"
    outside.write_bytes(png_bytes())
    (folder / "img1.png").unlink()
    (folder / "img1.png").symlink_to(outside)
    text = refused(api.post("/train", json=host.payload()), host.settings, launches)
    assert f"{FOLDER}/img1.png: a symlink" in text


def test_a_caption_linked_to_a_secret_is_refused_and_never_read(api, host, launches, folder, secret):
    (folder / "img0.txt").unlink()
    (folder / "img0.txt").symlink_to(secret)
    response = api.post("/train", json=host.payload())
    text = refused(response, host.settings, launches)
    assert f"{FOLDER}/img0.txt: a symlink" in text and "hunter2" not in response.get_data(as_text=True)


def test_a_fifo_caption_is_refused_without_blocking_the_request(api, host, launches, folder):
    (folder / "img0.txt").unlink()
    os.mkfifo(folder / "img0.txt")
    text = refused(post_bounded(api, host.payload()), host.settings, launches)
    assert f"{FOLDER}/img0.txt: a FIFO" in text


def test_a_caption_linked_to_dev_zero_is_refused_without_being_read(api, host, launches, folder):
    (folder / "img0.txt").unlink()
    (folder / "img0.txt").symlink_to("/dev/zero")
    text = refused(post_bounded(api, host.payload()), host.settings, launches)
    assert f"{FOLDER}/img0.txt: a symlink" in text


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "FIFO"),
    (lambda p: bound_socket(p), "socket"),
    (lambda p: p.symlink_to("/dev/null"), "symlink"),
])
def test_an_image_that_is_not_a_regular_file_is_refused_by_kind(api, host, launches, folder, make, kind):
    make(folder / "img9.png")
    text = refused(post_bounded(api, host.payload()), host.settings, launches)
    assert f"{FOLDER}/img9.png: a {kind}" in text


def test_a_caption_over_the_documented_cap_is_refused(api, host, launches, folder):
    (folder / "img0.txt").write_bytes(b"ohwx woman" + b"x" * CAPTION_MAX_BYTES)
    text = refused(api.post("/train", json=host.payload()), host.settings, launches)
    assert f"{FOLDER}/img0.txt: caption is larger than 64 KiB" in text


def test_a_caption_at_the_cap_is_accepted(api, host, launches, folder):
    (folder / "img0.txt").write_bytes(b"ohwx woman\n" + b"x" * (CAPTION_MAX_BYTES - 11))
    assert api.post("/train", json=host.payload()).status_code == 202


def test_a_link_in_the_dataset_that_sd_scripts_never_opens_is_left_alone(api, host, folder, secret):
    (folder / "notes").symlink_to(secret)  # neither an image nor an image's caption
    (host.dataset / "README").symlink_to(secret)  # not a subset name
    (folder / ".hidden.png").symlink_to(secret)  # glob("*.png") skips dot files
    response = api.post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()
    assert api.get(f"/train/{response.get_json()['worker_job_id']}").get_json()["image_count"] == 3


# -- folders sd-scripts would take as subsets ----------------------------------------------------------------

@pytest.mark.parametrize("name", [" 3_x", "+3_x", "3 _x", "\u0663_x", "3", "07_other thing"])
def test_a_folder_sd_scripts_reads_as_a_subset_is_refused_saying_what_it_would_do(api, host, launches, name):
    (host.dataset / name).mkdir()
    (host.dataset / name / "a.png").write_bytes(png_bytes())
    text = refused(api.post("/train", json=host.payload()), host.settings, launches)
    repeats = int(name.split("_")[0])
    assert repr(name) in text and f"sd-scripts would train on it as another subset with {repeats} repeats" in text


def test_a_symlink_named_like_a_subset_is_refused(api, host, launches, secret):
    (host.dataset / "5_x").symlink_to(secret.parent)
    text = refused(api.post("/train", json=host.payload()), host.settings, launches)
    assert "'5_x' (symlink)" in text


@pytest.mark.parametrize("name", ["0_x", "-1_x", "x_3", "abc", "3x_y"])
def test_a_folder_sd_scripts_skips_is_allowed(api, host, name):
    (host.dataset / name).mkdir()
    assert api.post("/train", json=host.payload()).status_code == 202


def test_a_regular_file_with_a_subset_name_is_allowed_sd_scripts_takes_only_directories(api, host):
    (host.dataset / "3_x").write_text("not a folder")
    assert api.post("/train", json=host.payload()).status_code == 202


# -- the LoRA path --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, kind", [
    (lambda p, h: p.write_bytes(b"old"), "regular file"),
    (lambda p, h: p.symlink_to(h.root / "outside" / "stolen.safetensors"), "symlink"),  # dangling
    (lambda p, h: p.symlink_to(h.model), "symlink"),
    (lambda p, h: p.mkdir(), "directory"),
    (lambda p, h: os.mkfifo(p), "FIFO"),
])
def test_any_entry_at_the_lora_path_is_output_exists_whatever_its_kind(api, host, launches, make, kind):
    output = host.dataset.parent / "output"
    output.mkdir()
    make(output / "ohwx_lora.safetensors", host)
    response = post_bounded(api, host.payload())
    body = response.get_json()
    assert body["error"] == "output_exists" and body["status"] == response.status_code and response.status_code < 500
    assert kind in body["message"] and rows(host.settings) == 0 and launches == []


def test_an_output_dir_inside_a_planted_link_is_contained_or_refused(api, host, launches):
    outside = host.root / "outside"
    outside.mkdir()
    (host.dataset.parent / "out-link").symlink_to(outside)
    response = api.post("/train", json=host.payload(output_dir=str(host.dataset.parent / "out-link" / "new")))
    refused(response, host.settings, launches, code="validation_failed")
    assert list(outside.iterdir()) == []


# -- paths the OS would refuse --------------------------------------------------------------------------------

def test_an_output_dir_near_path_max_is_a_422_not_a_500(api, host, launches):
    deep = host.dataset.parent
    while len(str(deep)) + 101 < 4080:  # existing directories, so only the LoRA's full path is too long
        deep = deep / ("d" * 100)
    deep = deep / ("e" * (4085 - len(str(deep)) - 1))
    os.makedirs(deep)
    lora = deep / "ohwx_lora.safetensors"
    assert len(str(deep)) < 4096 <= len(str(lora)) + 1  # the field is within bounds; the file's path is not
    response = api.post("/train", json=host.payload(output_dir=str(deep)))
    text = refused(response, host.settings, launches, code="validation_failed")
    assert "longer than the system's limit" in text


def test_a_component_longer_than_name_max_is_a_422(api, host, launches):
    long_name = str(host.dataset.parent / ("n" * (fs.NAME_MAX + 1)))
    for field in ("dataset_dir", "output_dir"):
        text = refused(api.post("/train", json=host.payload(**{field: long_name})), host.settings, launches,
                       code="validation_failed")
        assert "component longer than" in text


# -- relative names (#14) -------------------------------------------------------------------------------------

def test_relative_names_resolve_under_the_train_root_and_the_job_shows_absolute_paths(api, host):
    response = api.post("/train", json=host.payload(dataset_dir="t1/dataset", output_dir="t1/output"))
    assert response.status_code == 202, response.get_json()
    job = api.get(f"/train/{response.get_json()['worker_job_id']}").get_json()
    root = Path(os.path.realpath(host.settings.train_root))
    assert (job["dataset_dir"], job["output_dir"]) == (str(root / "t1" / "dataset"), str(root / "t1" / "output"))
    assert (root / "t1" / "output").is_dir()


@pytest.mark.parametrize("field, value", [
    ("dataset_dir", "../t1/dataset"), ("dataset_dir", "t1/../../x"), ("output_dir", "t1/../../out"),
    ("dataset_dir", "t1/escape"), ("output_dir", "t1/escape/out"), ("output_dir", "other/out"),
])
def test_a_relative_name_that_climbs_out_is_a_422_with_every_containment_rule_kept(api, host, launches, field, value):
    (host.dataset.parent / "escape").symlink_to(host.root)
    (Path(host.settings.train_root) / "other").mkdir()
    body = api.post("/train", json=host.payload(**{field: value})).get_json()
    assert body["status"] == 422 and field in body["fields"], body
    assert rows(host.settings) == 0 and launches == []


@pytest.mark.parametrize("value", ["t1/../../x", "../t1/dataset", "t1/./dataset"])
def test_the_path_layer_refuses_a_relative_name_that_climbs_even_without_the_schema(host, value):
    root = paths.real_train_root(host.settings.train_root)
    with pytest.raises(InvalidRequest) as raised:
        paths.resolve_dir(value, root, "dataset_dir")
    assert "dataset_dir" in raised.value.fields


def test_base_model_path_must_still_be_absolute(api, host, launches):
    response = api.post("/train", json=host.payload(base_model_path="models/sdxl_tiny.safetensors"))
    refused(response, host.settings, launches, code="validation_failed")


# -- identities recorded for the pre-exec check ---------------------------------------------------------------

def test_the_checked_directories_identities_are_recorded_with_the_job(api, host):
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    conn = sqlite3.connect(host.settings.database_path)
    try:
        row = conn.execute("SELECT dataset_dev_ino, kohya_dev_ino, output_dev_ino FROM jobs WHERE id=?",
                           (job_id,)).fetchone()
    finally:
        conn.close()
    expected = tuple(str(fs.FileId.of(os.stat(p))) for p in (
        host.dataset, host.dataset / FOLDER, host.dataset.parent / "output"))
    assert row == expected


# -- the artifact, end to end with the real supervisor --------------------------------------------------------

def run_until_saved(client, host, **modes) -> int:
    """Start a real run that pauses after `model saved.` (the trainer's teardown), and wait for that line."""
    set_modes(host.sd_scripts, teardown_s=3.0, **modes)
    response = client.post("/train", json=host.payload())
    assert response.status_code == 202, response.get_json()
    job_id = response.get_json()["worker_job_id"]
    wait_for(lambda: "model saved." in client.get(f"/train/{job_id}/log?lines=50").get_json()["text"],
             what="model saved.")
    return job_id


def final(client, job_id: int, timeout: float = 30.0) -> dict:
    return wait_for(lambda: (j := client.get(f"/train/{job_id}").get_json())["status"] in TERMINAL and j,
                    timeout=timeout, what=f"job {job_id} to end")


@pytest.mark.slow
def test_a_fifo_swapped_in_after_model_saved_fails_the_job_without_blocking_the_supervisor(client, host):
    job_id = run_until_saved(client, host)
    lora = host.dataset.parent / "output" / "ohwx_lora.safetensors"
    lora.unlink()
    os.mkfifo(lora)
    done = final(client, job_id)
    assert (done["status"], done["failure_class"]) == ("failed", "artifact_invalid"), done
    assert "FIFO" in done["error"] and done["lora_path"] is None


@pytest.mark.slow
def test_a_link_swapped_in_after_model_saved_is_not_reported_as_the_lora(client, host):
    job_id = run_until_saved(client, host)
    lora = host.dataset.parent / "output" / "ohwx_lora.safetensors"
    kept = host.root / "elsewhere.safetensors"
    lora.rename(kept)  # the real LoRA, moved out of the root; a link to it in its place
    lora.symlink_to(kept)
    done = final(client, job_id)
    assert (done["status"], done["failure_class"]) == ("failed", "artifact_invalid"), done
    assert "symlink" in done["error"]


@pytest.mark.slow
def test_a_lora_whose_mtime_is_before_the_run_still_succeeds_the_wall_clock_may_step_back(client, host):
    job_id = run_until_saved(client, host)
    lora = host.dataset.parent / "output" / "ohwx_lora.safetensors"
    os.utime(lora, (1_000_000_000, 1_000_000_000))  # as if the clock had stepped back to 2001 during the run
    done = final(client, job_id)
    assert done["status"] == "succeeded", done
    assert done["lora_sha256"] == hashlib.sha256(lora.read_bytes()).hexdigest()

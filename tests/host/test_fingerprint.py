"""Each job's reproducibility fingerprint and its verified artifact, queryable with sqlite3."""
from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3

import pytest

from lora_worker.host.fingerprint import sd_scripts_commit, trainer_versions
from lora_worker.dispatch.dataset import inspect_dataset
from tests.helpers import SD_SCRIPTS_COMMIT, TRAINER_VERSIONS
from tests.helpers.fake_trainer import load_fake_trainer
from tests.helpers.runs import TERMINAL, modes, submit, wait_state


def query(settings, sql: str, *params: object) -> list[tuple]:
    conn = sqlite3.connect(settings.database_path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


@pytest.mark.slow
def test_a_finished_job_carries_its_fingerprint_and_artifact_hash(client, host):
    modes(host)
    job_id = submit(client, host)
    done = wait_state(client, job_id, *TERMINAL)
    assert done["status"] == "succeeded"
    data = (host.dataset.parent / "output" / "ohwx_lora.safetensors").read_bytes()
    assert (done["lora_sha256"], done["lora_size"]) == (hashlib.sha256(data).hexdigest(), len(data))
    assert done["sd_scripts_commit"] == SD_SCRIPTS_COMMIT and done["trainer_versions"] == TRAINER_VERSIONS
    assert done["dataset_sha256"] == inspect_dataset(host.dataset, "10_ohwx woman").sha256()
    # what the fake hashes for sd-scripts' calculate_sha256 (of a sparse checkpoint, its written extents)
    assert done["base_model_sha256"] == load_fake_trainer().sha256_of(str(host.model))
    rows = query(host.settings, "SELECT json_extract(trainer_versions, '$.torch'), json_array_length(argv), "
                                "sd_scripts_commit, lora_sha256 FROM jobs WHERE id = ?", job_id)
    assert rows == [("2.7.0", len(json.loads(query(host.settings, "SELECT argv FROM jobs")[0][0])),
                     SD_SCRIPTS_COMMIT, done["lora_sha256"])]


@pytest.mark.slow
def test_without_a_git_checkout_the_commit_comes_from_the_lora(client, host):
    shutil.rmtree(host.sd_scripts / ".git")
    modes(host)
    done = wait_state(client, submit(client, host), *TERMINAL)
    assert done["sd_scripts_commit"] == "48d368fa557731ad0488c07304dfeba8c07910eb"  # ss_sd_scripts_commit_hash


def test_the_dataset_hash_follows_names_sizes_and_captions(host):
    before = inspect_dataset(host.dataset, "10_ohwx woman").sha256()
    caption = host.dataset / "10_ohwx woman" / "img0.txt"
    caption.write_text("ohwx woman, smiling")
    after = inspect_dataset(host.dataset, "10_ohwx woman").sha256()
    caption.write_text("ohwx woman, portrait")
    assert before != after
    assert inspect_dataset(host.dataset, "10_ohwx woman").sha256() == before  # the same content, the same hash


def test_package_versions_are_read_from_metadata_not_imported(host, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_trainer_imports(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert name.split(".")[0] not in TRAINER_VERSIONS, f"imported {name}"
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_trainer_imports)
    assert trainer_versions(host.settings.accelerate) == TRAINER_VERSIONS


def test_the_commit_is_read_from_packed_refs_and_detached_heads(tmp_path):
    git = tmp_path / ".git"
    git.mkdir()
    (git / "HEAD").write_text("ref: refs/heads/sd3\n")
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{'a' * 40} refs/heads/sd3\n")
    assert sd_scripts_commit(tmp_path) == "a" * 40
    (git / "HEAD").write_text("b" * 40 + "\n")
    assert sd_scripts_commit(tmp_path) == "b" * 40
    assert sd_scripts_commit(tmp_path / "nowhere") is None


def test_the_commit_of_a_worktree_checkout_is_found_in_the_main_repository(tmp_path):
    # `git worktree add` layout: the checkout's .git is a file; its git dir holds HEAD and `commondir`,
    # and the branch it names lives in the main repository's refs
    main = tmp_path / "main" / ".git"
    (main / "refs" / "heads").mkdir(parents=True)
    (main / "refs" / "heads" / "sd3").write_text("c" * 40 + "\n")
    own = main / "worktrees" / "sd-scripts"
    own.mkdir(parents=True)
    (own / "HEAD").write_text("ref: refs/heads/sd3\n")
    (own / "commondir").write_text("../..\n")
    checkout = tmp_path / "sd-scripts"
    checkout.mkdir()
    (checkout / ".git").write_text(f"gitdir: {own}\n")
    assert sd_scripts_commit(checkout) == "c" * 40

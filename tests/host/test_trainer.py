"""The trainer check refuses tokenizers that exist but would kill the run after the model has loaded."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from lora_worker.errors import TrainerUnavailable
from lora_worker.host.trainer import TOKENIZER_DIRS, missing_trainer_parts, require_trainer, tokenizer_problems
from tests.helpers import clip_tokenizer_files, job_rows, write_tokenizer

GOOD = clip_tokenizer_files()


def test_the_generated_clip_tokenizer_passes(tmp_path):
    assert tokenizer_problems(write_tokenizer(tmp_path / "tok")) == []


@pytest.mark.parametrize("name, data, says", [
    # fail_tokenizer_hollow.log: `{}` and an empty merges.txt, no tokenizer_config.json
    ("vocab.json", b"{}", "0 tokens"),
    ("vocab.json", b"[1, 2]", "not a JSON object"),
    ("vocab.json", b'{"a": 0', "not JSON"),
    ("vocab.json", json.dumps({f"t{i}": i for i in range(49407)}).encode(), "49407 tokens"),
    ("vocab.json", b"\xff\xfe{}", "not UTF-8"),
    ("merges.txt", b"", "'#version'"),
    ("merges.txt", GOOD["merges.txt"].split(b"\n", 1)[1], "'#version'"),
    ("merges.txt", b"#version: 0.2\na b\n", "1 merges"),
    ("tokenizer_config.json", None, "missing"),  # sd-scripts' max_length becomes 10^30
    ("tokenizer_config.json", b"{}", "model_max_length is None"),
    ("tokenizer_config.json", json.dumps({"model_max_length": 1e30}).encode(), "model_max_length is 1e+30"),
    ("tokenizer_config.json", json.dumps({"model_max_length": 77.0}).encode(), "model_max_length is 77.0"),
])
def test_a_broken_tokenizer_file_is_named_with_what_is_wrong(tmp_path, name, data, says):
    folder = write_tokenizer(tmp_path / "tok", **{name.replace(".", "_"): data})
    problems = tokenizer_problems(folder)
    assert len(problems) == 1 and str(folder / name) in problems[0] and says in problems[0], problems


def test_more_merges_than_the_tokenizer_reads_are_fine(tmp_path):
    folder = write_tokenizer(tmp_path / "tok", merges_txt=GOOD["merges.txt"] + b"extra merge\n")
    assert tokenizer_problems(folder) == []


def test_a_fifo_in_place_of_a_tokenizer_file_is_refused_without_blocking(tmp_path):
    folder = write_tokenizer(tmp_path / "tok", vocab_json=None)
    os.mkfifo(folder / "vocab.json")
    result: list[list[str]] = []
    worker = threading.Thread(target=lambda: result.append(tokenizer_problems(folder)), daemon=True)
    worker.start()
    worker.join(5)
    assert result, "reading the tokenizer blocked on a FIFO"
    assert "not a regular file" in result[0][0]


def test_a_directory_or_a_huge_file_in_place_of_a_tokenizer_file_is_refused(tmp_path):
    folder = write_tokenizer(tmp_path / "tok", merges_txt=None, tokenizer_config_json=None)
    (folder / "merges.txt").mkdir()
    with (folder / "tokenizer_config.json").open("wb") as fh:
        fh.truncate(64 * 1024 * 1024)  # sparse: the check must refuse it by size, not read it
    problems = tokenizer_problems(folder)
    assert any("merges.txt" in p and "not a regular file" in p for p in problems)
    assert any("tokenizer_config.json" in p and "more than a tokenizer file ever has" in p for p in problems)


@pytest.mark.own_tokenizers  # it breaks its host's tokenizers
def test_the_install_check_names_every_broken_file_of_both_tokenizers(settings):
    first, second = (settings.tokenizer_cache_dir / name for name in TOKENIZER_DIRS)
    (first / "vocab.json").write_bytes(b"{}")
    (second / "tokenizer_config.json").unlink()
    missing = missing_trainer_parts(settings)
    assert [p.split(":")[0] for p in missing] == [f"tokenizer file {first / 'vocab.json'}",
                                                   f"tokenizer file {second / 'tokenizer_config.json'}"]
    with pytest.raises(TrainerUnavailable) as caught:
        require_trainer(settings)
    assert str(first / "vocab.json") in caught.value.message and caught.value.details["missing"] == missing


@pytest.mark.own_tokenizers  # it breaks its host's tokenizers
def test_hollow_tokenizers_are_a_503_that_changes_nothing(api, host, launches):
    folder = host.settings.tokenizer_cache_dir / TOKENIZER_DIRS[1]
    write_tokenizer(folder, vocab_json=b"{}", merges_txt=b"")
    (folder / "tokenizer_config.json").unlink()
    response = api.post("/train", json=host.payload())
    body = response.get_json()
    assert response.status_code == 503 and body["error"] == "trainer_unavailable"
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert str(Path(folder, name)) in body["message"]
    assert job_rows(host.settings) == 0 and launches == []


def test_a_file_that_passed_is_not_parsed_again_until_it_changes(tmp_path, monkeypatch):
    """The check parses ~1 MB of JSON per vocab.json (16 ms of each dispatch); the very file that passed is
    taken as passed, and any write to it (a new ctime) or a file renamed over it (a new inode) is checked again."""
    from lora_worker.host import trainer

    folder = write_tokenizer(tmp_path / "tok")
    parsed: list[int] = []
    real = trainer.check_vocab
    # The memory is the process's: a deep check an earlier test's app left running in this worker may fill it
    # past its bound and clear it between two calls here (CI, 2026-12-06). This test's own memory, unbounded.
    monkeypatch.setattr(trainer, "_PASSED", {})
    monkeypatch.setattr(trainer, "_PASSED_MAX", 1 << 20)
    monkeypatch.setitem(trainer.FILE_CHECKS, "vocab.json", lambda data: (parsed.append(len(data)), real(data)))
    assert tokenizer_problems(folder) == [] and tokenizer_problems(folder) == [] and len(parsed) == 1
    vocab = folder / "vocab.json"
    time.sleep(0.02)  # past a coarse clock's tick (the kernel's file times may move in jiffies)
    with vocab.open("r+b") as fh:  # the same size, in place: only its times say it changed
        fh.write(b"[")
    assert "not JSON" in tokenizer_problems(folder)[0]
    assert "not JSON" in tokenizer_problems(folder)[0] and len(parsed) == 3  # a refusal is never remembered
    replacement = tmp_path / "vocab.json"
    replacement.write_bytes(GOOD["vocab.json"])
    os.replace(replacement, vocab)
    assert tokenizer_problems(folder) == [] and len(parsed) == 4
    os.replace(folder / "tokenizer_config.json", vocab)  # another file, another inode: checked, and refused
    assert "tokens; CLIP's vocabulary has" in tokenizer_problems(folder)[0]

"""Issue 32: the dataset presented so that one epoch covers the run (dispatch/presentation.py), its TOML, and where
it lives; and docs/resume.md's table of resumable states before and after, computed from the same functions."""
from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import tomllib
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from lora_worker.config import REPO_ROOT
from lora_worker.dispatch import presentation
from lora_worker.dispatch.presentation import config_for, dataset_config_toml
from lora_worker.errors import DatasetInvalid, LaunchFailed
from lora_worker.run.local import LocalBackend
from lora_worker.slurm.backend import SlurmBackend
from tests.helpers import job_rows
from tests.helpers.examples import examples
from tests.helpers.resumable_table import table


# -- the one rule -------------------------------------------------------------------------------------------------

@hsettings(max_examples=examples(500), deadline=None)
@given(images=st.integers(1, 500), batch=st.integers(1, 4), steps=st.integers(1, 6000), every=st.integers(2, 500))
def test_one_epoch_is_the_smallest_repeats_that_hold_every_step_so_every_state_resumes(images, batch, steps, every):
    shown = presentation.presentation(images, batch, steps, every)
    assert images * shown.repeats / batch >= steps and shown.steps_per_epoch >= steps and shown.epochs == 1
    assert shown.repeats == 1 or images * (shown.repeats - 1) / batch < steps  # one fewer would not
    assert [s.step for s in shown.states] == list(range(every, steps + 1, every))
    assert all(s.resumable == (s.step < steps) for s in shown.states)  # only a state at the last step is not


@pytest.mark.parametrize("images, repeats, batch, per_epoch, fast, balanced", [
    # issue 32's table: the folder's own repeats (the rule before it)
    (20, 10, 1, 200, [(150, True), (300, False)], [(400, False), (800, False), (1200, False)]),
    (20, 10, 2, 100, [(150, False), (300, False)], [(400, False), (800, False), (1200, False)]),
    (15, 5, 1, 75, [(150, False), (300, False)], [(400, False), (800, False), (1200, False)]),
    (15, 5, 2, 38, [(150, False), (300, False)], [(400, False), (800, False), (1200, False)]),
])
def test_the_folders_own_repeats_left_most_states_past_the_first_epoch(images, repeats, batch, per_epoch, fast,
                                                                       balanced):
    def as_folder(steps: int, every: int) -> presentation.Presentation:
        return presentation.presentation(images, batch, steps, every, folder_repeats=repeats)
    assert as_folder(400, 150).steps_per_epoch == per_epoch
    assert [(s.step, s.resumable) for s in as_folder(400, 150).states] == fast
    assert [(s.step, s.resumable) for s in as_folder(1500, 400).states] == balanced


def test_docs_resume_md_holds_the_table_the_functions_compute():
    assert table() in (REPO_ROOT / "docs" / "resume.md").read_text()


# -- the TOML ---------------------------------------------------------------------------------------------------

def carryable(value: str) -> bool:
    return not any(ch == "'" or (ch != "\t" and unicodedata.category(ch) in ("Cc", "Cs")) for ch in value)


@hsettings(max_examples=examples(1000), deadline=None)
@given(image_dir=st.text(max_size=40), tokens=st.text(max_size=40), repeats=st.integers(1, 10**6))
def test_the_toml_reads_back_exactly_what_was_written_or_is_refused_saying_why(image_dir, tokens, repeats):
    """Whatever a path or a token holds: read back by a TOML parser as exactly those strings, or refused (a 422,
    never an escape: sd-scripts' parser mis-reads them, tests/rig/test_real_presentation.py)."""
    try:
        content = dataset_config_toml(image_dir, tokens, repeats)
    except DatasetInvalid as exc:
        assert not (carryable(image_dir) and carryable(tokens))
        assert "cannot carry exactly" in json.dumps(exc.details)
        return
    assert carryable(image_dir) and carryable(tokens)
    assert tomllib.loads(content.decode("utf-8")) == {"datasets": [{"subsets": [
        {"image_dir": image_dir, "class_tokens": tokens, "num_repeats": repeats}]}]}


@pytest.mark.parametrize("hostile", ["a'b", "x\ny", "a\rb", "q\x00", "\x7f", "\ud800"])
def test_a_quote_or_control_character_never_breaks_out(hostile):
    with pytest.raises(DatasetInvalid):
        dataset_config_toml(f"/t/{hostile}/10_ohwx woman", "ohwx woman", 3)
    with pytest.raises(DatasetInvalid):
        dataset_config_toml("/t/10_ohwx woman", f"ohwx {hostile}", 3)


# -- where it lives, and its writing --------------------------------------------------------------------------------

def resolved(host, **overrides):
    from lora_worker.dispatch.request import TrainRequest, resolve_request

    values = {**host.payload(), **overrides}
    raw = TrainRequest(**values)
    return resolve_request(raw, train_id="t1", dataset_dir=Path(values["dataset_dir"]),
                           base_model_path=Path(values["base_model_path"]), output_dir=Path(values["output_dir"]))


def test_the_config_lies_where_the_trainers_host_reads_it_named_by_its_content(host):
    settings = host.settings.with_overrides(slurm_log_dir=host.root / "shared")
    req = resolved(host)
    local, slurm = config_for(req, settings, LocalBackend(), 3), config_for(req, settings, SlurmBackend(), 3)
    assert local.path.parent == settings.state_dir / "datasets"
    assert slurm.path.parent == host.root / "shared" / "datasets"  # the nodes read the Slurm log dir
    for made in (local, slurm):
        assert made.path.name == hashlib.sha256(made.content).hexdigest() + ".toml"
    batch = settings.slurm_resources["fast"].train_batch_size
    assert slurm.presentation.repeats == math.ceil(400 * batch / 3)


def test_writing_twice_leaves_the_same_bytes_newer_and_nothing_beside(host):
    made = config_for(resolved(host), host.settings, LocalBackend(), 3)
    presentation.write(made)
    os.utime(made.path, (1, 1))
    presentation.write(made)
    assert made.path.read_bytes() == made.content and made.path.stat().st_mtime > 1
    assert os.listdir(made.path.parent) == [made.path.name]


def test_a_config_that_cannot_be_written_is_a_launch_failure(host):
    made = config_for(resolved(host), host.settings, LocalBackend(), 3)
    made.path.parent.parent.mkdir(parents=True, exist_ok=True)
    made.path.parent.write_text("a file where the directory goes")
    with pytest.raises(LaunchFailed, match="Cannot write the dataset config"):
        presentation.write(made)


def test_post_train_writes_the_config_its_argv_names(api, host):
    answer = api.post("/train", json=host.payload())
    assert answer.status_code == 202, answer.get_json()
    conn = sqlite3.connect(host.settings.database_path)
    (argv,) = conn.execute("SELECT argv FROM jobs").fetchone()
    conn.close()
    (path,) = [a.split("=", 1)[1] for a in json.loads(argv) if a.startswith("--dataset_config=")]
    content = Path(path).read_bytes()
    assert Path(path).name == hashlib.sha256(content).hexdigest() + ".toml"
    assert tomllib.loads(content.decode())["datasets"][0]["subsets"][0]["num_repeats"] == math.ceil(400 * 2 / 3)


def test_a_dataset_path_no_config_can_carry_is_refused_and_nothing_is_written(api, host):
    quoted = host.root / "train" / "t'1" / "dataset"
    quoted.parent.mkdir(parents=True)
    os.rename(host.dataset, quoted)
    answer = api.post("/train", json=host.payload(dataset_dir=str(quoted), output_dir=str(quoted.parent / "out")))
    assert answer.status_code == 422 and answer.get_json()["error"] == "dataset_invalid", answer.get_json()
    assert "cannot carry exactly" in json.dumps(answer.get_json())
    assert job_rows(host.settings) == 0 and not (host.settings.state_dir / "datasets").exists()
    assert not (quoted.parent / "out").exists()

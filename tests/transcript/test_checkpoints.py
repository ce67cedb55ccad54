"""Step checkpoints as the transcript sees them: the save lines the parser keeps (whole lines only), and
transcript/checkpoints.py's rows: each step LoRA verified once the trainer moved on, removals marked removed,
failures recorded without ending anything."""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest

from lora_worker.host.fs import FileId
from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.parser import Parser, Save
from tests.helpers import DATA
from tests.helpers.fake_trainer import load_fake_trainer
from tests.helpers.checkpoints import WatchedJob

FAKE = load_fake_trainer()
BAR = "\rsteps:  {pct}%|█         | {n}/9 [00:01<00:02,  3.90it/s, avr_loss=0.5]"


def capture(name: str) -> bytes:
    lines = (DATA / f"{name}.jsonl").read_text().splitlines()[1:]
    return b"".join(base64.b64decode(c["b64"]) for c in map(json.loads, lines))


def test_the_real_runs_step_save_is_kept_with_the_redraws_before_it():
    """run5 (a real run with --save_every_n_steps=5): its step save, its epoch save and its final save."""
    parser = Parser()
    parser.feed(capture("run5_epochs_saves"))
    parser.close()
    saves = parser.progress.saves
    assert [(s.kind, s.text.rsplit("/", 1)[1]) for s in saves] == [
        ("saving", "ohwx-step00000005.safetensors"), ("saving", "ohwx-000001.safetensors"),
        ("saving", "ohwx-step00000010.safetensors"), ("saving", "ohwx.safetensors")]
    assert all(parser.progress.redraws > s.redraws for s in saves)  # a redraw followed every save


def state_save_lines(out: str, step: int, old: int | None = None) -> str:
    """What a save prints with --save_state (train_network.py save_model; train_util.py
    save_and_remove_state_stepwise; accelerate 1.6.0 save_state), as the fake trainer prints it."""
    state = f"{out}/ohwx-step{step:08d}-state"
    text = (f"\nsaving checkpoint: {out}/ohwx-step{step:08d}.safetensors\n\nsaving state at step {step}\n"
            f"Saving current state to {state}\nsave train state to {state}/train_state.json at epoch 1 step {step}\n"
            f"Model weights saved in {state}/model.safetensors\nRandom states saved in {state}/random_states_0.pkl\n")
    if old is not None:
        text += (f"removing old state: {out}/ohwx-step{old:08d}-state\n"
                 f"removing old checkpoint: {out}/ohwx-step{old:08d}.safetensors\n")
    return text


def test_the_state_lines_and_removals_are_kept_in_order():
    parser = Parser()
    parser.feed(BAR.format(pct=22, n=2) + state_save_lines("/o", 2) + BAR.format(pct=44, n=4)
                + state_save_lines("/o", 4, old=2) + BAR.format(pct=55, n=5) + "\n\nsaving last state.\n")
    assert [(s.kind, s.text) for s in parser.progress.saves] == [
        ("saving", "/o/ohwx-step00000002.safetensors"), ("state_saved", "2"),
        ("saving", "/o/ohwx-step00000004.safetensors"), ("state_saved", "4"),
        ("removed_state", "/o/ohwx-step00000002-state"), ("removed_checkpoint", "/o/ohwx-step00000002.safetensors"),
        ("last_state", "5")]


@pytest.mark.parametrize("text", [
    "load StableDiffusion checkpoint: /m/saving state at step 3\n",  # a path holding the words
    "caption: removing old checkpoint: /o/ohwx-step00000002.safetensors\n",
    "saving state at step 3 please\n",  # not sd-scripts' line: more after it
    "ValueError: saving last state.\n",
])
def test_a_save_line_counts_only_as_sd_scripts_own_whole_line(text):
    parser = Parser()
    parser.feed(text)
    parser.close()
    assert parser.progress.saves == []


def test_cut_anywhere_the_saves_are_the_same():
    text = (BAR.format(pct=22, n=2) + state_save_lines("/o", 2) + BAR.format(pct=44, n=4)).encode()
    whole = Parser()
    whole.feed(text)
    for cut in range(1, len(text)):
        parser = Parser()
        parser.feed(text[:cut])
        parser.feed(text[cut:])
        assert parser.progress.saves == whole.progress.saves, cut


# -- the rows ------------------------------------------------------------------------------------------------------



def write_step_lora(out: Path, step: int, **overrides: str) -> Path:
    """A step LoRA as the fake trainer writes one (its writer: the real run's modules, sparse)."""
    path = out / f"ohwx-step{step:08d}.safetensors"
    metadata = {"ss_network_dim": "4", "ss_output_name": "ohwx", "ss_max_train_steps": "9", "ss_seed": "42",
                "ss_steps": str(step), **overrides}
    FAKE.save_lora(str(path), 4, 4.0, metadata, precision="fp16")
    return path


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "output"
    path.mkdir()
    return path


def fed(parser: Parser, text: str) -> Parser:
    parser.feed(text)
    return parser


def test_a_step_lora_is_verified_only_once_a_redraw_follows_its_save(out):
    lora = write_step_lora(out, 2)
    watcher = Checkpoints(WatchedJob(str(out), output_dev_ino=str(FileId.of(out.stat()))))
    parser = fed(Parser(), BAR.format(pct=22, n=2) + state_save_lines(str(out), 2))
    first = watcher.take(parser.progress, ended=False)
    assert sorted((r.kind, r.step, r.verified) for r in first) == [("lora", 2, None), ("state", 2, None)]
    fed(parser, BAR.format(pct=33, n=3))
    [verified] = watcher.take(parser.progress, ended=False)
    assert (verified.kind, verified.step, verified.verified, verified.error) == ("lora", 2, True, None)
    assert (verified.bytes, verified.sha256) == (lora.stat().st_size, hashlib.sha256(lora.read_bytes()).hexdigest())
    assert watcher.take(parser.progress, ended=False) == []  # once


def test_at_the_end_the_last_step_lora_is_verified_without_a_redraw(out):
    write_step_lora(out, 2)
    watcher = Checkpoints(WatchedJob(str(out)))
    parser = fed(Parser(), BAR.format(pct=22, n=2) + state_save_lines(str(out), 2))
    watcher.take(parser.progress, ended=False)
    assert [r.verified for r in watcher.take(parser.progress, ended=True)] == [True]


def test_a_cut_or_wrong_step_lora_is_recorded_unverified_with_why(out):
    cut = write_step_lora(out, 2)
    with cut.open("r+b") as fh:
        fh.truncate(cut.stat().st_size // 2)  # killed mid-write: written in place
    write_step_lora(out, 4, ss_steps="3")
    watcher = Checkpoints(WatchedJob(str(out)))
    parser = fed(Parser(), state_save_lines(str(out), 2) + state_save_lines(str(out), 4))
    rows = {r.step: r for r in watcher.take(parser.progress, ended=True) if r.kind == "lora"}
    assert rows[2].verified is False and "truncated" in (rows[2].error or "") and rows[2].sha256 is None
    assert (rows[4].verified, rows[4].error) == (False, "ss_steps '3' instead of 4")


def test_a_step_lora_the_trainer_removed_is_marked_removed_not_failed(out):
    write_step_lora(out, 4)  # step 2's file is gone: the trainer removed it
    watcher = Checkpoints(WatchedJob(str(out)))
    parser = fed(Parser(), BAR.format(pct=22, n=2) + state_save_lines(str(out), 2) + BAR.format(pct=44, n=4)
                 + state_save_lines(str(out), 4, old=2) + BAR.format(pct=55, n=5))
    rows = {(r.kind, r.step): r for r in watcher.take(parser.progress, ended=False)}
    assert rows[("lora", 2)].removed_at is not None and rows[("lora", 2)].verified is None
    assert rows[("lora", 2)].error is None
    assert rows[("state", 2)].removed_at is not None and rows[("state", 4)].removed_at is None
    assert (rows[("lora", 4)].verified, rows[("lora", 4)].removed_at) == (True, None)


def test_saves_of_another_directory_or_name_and_the_final_lora_are_no_checkpoints(out, tmp_path):
    write_step_lora(out, 2)
    watcher = Checkpoints(WatchedJob(str(out)))
    other = tmp_path / "elsewhere"
    parser = fed(Parser(), f"saving checkpoint: {other}/ohwx-step00000002.safetensors\n"
                           f"saving checkpoint: {out}/other-step00000002.safetensors\n"
                           f"saving checkpoint: {out}/ohwx-000001.safetensors\n"
                           f"saving checkpoint: {out}/ohwx.safetensors\n")
    assert watcher.take(parser.progress, ended=True) == []


def test_a_link_at_a_step_loras_path_is_not_followed(out, tmp_path):
    real = write_step_lora(tmp_path, 2)
    (out / real.name).symlink_to(real)
    watcher = Checkpoints(WatchedJob(str(out)))
    parser = fed(Parser(), state_save_lines(str(out), 2))
    [row] = [r for r in watcher.take(parser.progress, ended=True) if r.kind == "lora"]
    assert row.verified is False and row.sha256 is None


def test_saves_arrive_as_the_parser_keeps_them():
    assert Save("saving", "/o/x", 3) == Save("saving", "/o/x", 3)  # frozen, comparable: chunking tests rely on it

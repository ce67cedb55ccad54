"""The real trainer's runs with step states (tests/data/rig: R1, R2, R6, R7 of docs/reference/sd-scripts-resume.md)
through the worker's transcript: the save lines the parser keeps, the `checkpoints` rows transcript/checkpoints.py
makes of them (each step LoRA verified on a file with the real step LoRA's header), the resumed run's step and
total, and how each run ends (transcript/outcome.py)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lora_worker.host.safetensors import ArtifactCheck
from lora_worker.transcript.checkpoints import Checkpoints
from lora_worker.transcript.outcome import decide
from lora_worker.transcript.parser import Parser
from lora_worker.states import FailureClass, JobState
from tests.helpers.rig_captures import RIG, flag, meta, stream
from tests.helpers.checkpoints import WatchedJob

R1, R2, R6, R7 = ("states_killed_after_step4", "resume_skip_from_step4", "resume_skip_past_epoch1",
                  "resume_truncated_optimizer")




def parsed(name: str, out: Path, step_offset: int = 0) -> Parser:
    """The capture as the supervisor's pipe gives it, its output dir moved to `out`."""
    parser = Parser(step_offset)
    parser.feed(stream(name).replace(flag(meta(name)["argv"], "output_dir").encode(), str(out).encode()))
    parser.close()
    return parser


def write_real_step_lora(out: Path, step: int) -> None:
    """R1's real step-4 LoRA header (tests/data/rig/step-lora-step4.header.json) at step `step`, data sparse."""
    header = json.loads((RIG / "step-lora-step4.header.json").read_text())
    header["__metadata__"]["ss_steps"] = str(step)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    path = out / f"ohwx-step{step:08d}.safetensors"
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + end)


def rows(parser: Parser, out: Path) -> list[tuple[str, int, str, bool | None, bool]]:
    taken = Checkpoints(WatchedJob(str(out), lora_steps=8)).take(parser.progress, ended=True)
    return sorted((r.kind, r.step, Path(r.path).name, r.verified, r.removed_at is not None) for r in taken)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "output"
    path.mkdir()
    return path


def test_a_run_killed_after_its_second_state_leaves_the_rows_of_what_it_saved(out):
    for step in (2, 4):
        write_real_step_lora(out, step)
    parser = parsed(R1, out)
    assert [(s.kind, Path(s.text).name) for s in parser.progress.saves] == [
        ("saving", "ohwx-step00000002.safetensors"), ("state_saved", "2"),
        ("saving", "ohwx-step00000004.safetensors"), ("state_saved", "4"), ("removed_state", "ohwx-step00000002-state")]
    assert all(parser.progress.redraws > s.redraws for s in parser.progress.saves)  # each save finished
    assert (parser.progress.step, parser.progress.total_steps) == (4, 8)
    assert rows(parser, out) == [
        ("lora", 2, "ohwx-step00000002.safetensors", True, False),
        ("lora", 4, "ohwx-step00000004.safetensors", True, False),
        ("state", 2, "ohwx-step00000002-state", None, True), ("state", 4, "ohwx-step00000004-state", None, False)]


def test_the_resumed_run_counts_from_the_state_and_records_its_saves_and_removals(out):
    for step in (6, 8):
        write_real_step_lora(out, step)
    parser = parsed(R2, out, step_offset=4)
    assert (parser.progress.step, parser.progress.total_steps) == (8, 8)
    assert "model_saved" in parser.progress.flags
    assert [(s.kind, Path(s.text).name) for s in parser.progress.saves][-3:] == [
        ("removed_checkpoint", "ohwx-step00000002.safetensors"), ("last_state", "8"), ("saving", "ohwx.safetensors")]
    assert rows(parser, out) == [
        ("lora", 2, "ohwx-step00000002.safetensors", None, True),  # the first attempt's, pruned by this one
        ("lora", 6, "ohwx-step00000006.safetensors", True, False),
        ("lora", 8, "ohwx-step00000008.safetensors", True, False),
        ("state", 4, "ohwx-step00000004-state", None, True),  # the state it resumed from
        ("state", 6, "ohwx-step00000006-state", None, True), ("state", 8, "ohwx-state", None, False),
        ("state", 8, "ohwx-step00000008-state", None, False)]
    tail = [line for line in stream(R2).decode().split("\n") if line.strip()]
    done = decide(returncode=0, progress=parser.progress, log_tail=tail, artifact=ArtifactCheck(str(out)))
    assert done.state is JobState.SUCCEEDED  # `Could not load random states` (the rig's CPU) is no failure


def test_a_resume_past_epoch_1_is_recorded_under_the_names_the_trainer_printed(out):
    """R6 (the resume the worker refuses): its save is announced as step 2 (real step 5) and recorded as such."""
    parser = parsed(R6, out, step_offset=4)
    assert [(s.kind, s.text) for s in parser.progress.saves if s.kind == "state_saved"] == [("state_saved", "2")]
    assert ("state", 2, "ohwx-step00000002-state", None, False) in rows(parser, out)


def test_a_truncated_optimizer_ends_as_a_trainer_crash_named_by_torchs_line(out):
    parser = parsed(R7, out, step_offset=4)
    assert parser.progress.saves == [] and parser.progress.inner_exit == 1
    tail = [line.rsplit("\r", 1)[-1].rstrip() for line in stream(R7).decode().split("\n") if line.strip()]
    failed = decide(returncode=meta(R7)["rc"], progress=parser.progress, log_tail=tail)
    assert (failed.state, failed.failure_class) == (JobState.FAILED, FailureClass.TRAINER_CRASHED)
    assert failed.error.startswith("RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
                                   "central directory.")

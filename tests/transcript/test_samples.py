"""Sample passes as the transcript sees them (issue 33): the parser's `sampling` phase and passes from the real
trainer's lines, the unnamed sampler bar never taken for training progress, the watchdog's and the ETA's reading
of a pass, a failure in a pass said for what it left, and transcript/samples.py's discovery of the images in a
hostile output directory (names parsed strictly, no link followed, sizes bounded, each image decoded)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lora_worker.config_tables import DEFAULT_STALL_LIMITS_S
from lora_worker.host.fs import FileId
from lora_worker.host.images import MAX_SAMPLE_BYTES
from lora_worker.ledger.checkpoints import LORA, CheckpointRow
from lora_worker.ledger.statements import utcnow
from lora_worker.states import Phase
from lora_worker.transcript.eta import EtaClock
from lora_worker.transcript.outcome import decide
from lora_worker.transcript.parser import Parser
from lora_worker.transcript.samples import Samples, sample_every_of
from lora_worker.transcript.watchdog import Watchdog
from tests.helpers.fake_trainer import load_fake_trainer
from tests.helpers.rig_captures import RIG, chunks, stream

FAKE = load_fake_trainer()
S1 = "samples_run"
PASS = "\ngenerating sample images at step / サンプル画像生成 ステップ: {step}\n"
BAR = "\rsteps:  {pct}%|█         | {n}/6 [00:01<00:02,  3.90it/s, avr_loss=0.5]"
SAMPLER = "\n\r 50%|█████     | 2/4 [00:06<00:06,  3.02s/it]\x1b[A"  # the pass's own bar, at position 1


def parsed(data: bytes, cut: int = 0) -> Parser:
    parser = Parser()
    for at in range(0, len(data), cut or len(data)):
        parser.feed(data[at:at + (cut or len(data))])
    parser.close()
    return parser


# -- the parser, on the real trainer's output ----------------------------------------------------------------------

@pytest.mark.parametrize("cut", [0, 1, 7, 4096])
def test_the_real_runs_passes_are_a_phase_of_their_own_and_their_bar_is_no_step(cut):
    """S1: a pass before the first step, then at steps 2, 4 and 6 (before each step save), however the pipe cut."""
    p = parsed(stream(S1), cut).progress
    assert [step for step, _ in p.passes] == [0, 2, 4, 6]
    assert p.phases == [Phase.LOADING_MODEL, Phase.CACHING_LATENTS, Phase.CACHING_TEXT_ENCODER_OUTPUTS,
                        Phase.PREPARING_TRAINING, Phase.SAMPLING, Phase.TRAINING,
                        *[Phase.SAMPLING, Phase.SAVING, Phase.TRAINING] * 3, Phase.SAVING]
    assert (p.step, p.total_steps) == (6, 6) and "model_saved" in p.flags


def test_in_a_pass_the_step_is_the_one_sampled_whatever_its_bar_says():
    """Fed chunk by chunk, as the supervisor takes the pipe: from the pass line of step 2 to the save, the step
    stays 2 and the phase `sampling`, through every redraw of the sampler's `n/4` bar."""
    parser, seen = Parser(), []
    for _, data in chunks(S1):
        parser.feed(data)
        if parser.progress.passes and parser.progress.passes[-1][0] == 2 and parser.progress.phase is Phase.SAMPLING:
            seen.append((parser.progress.step, parser.progress.total_steps))
    assert len(seen) > 10 and set(seen) == {(2, 6)}


def test_a_pass_line_counts_only_as_sd_scripts_own_whole_line():
    for text in ("prompt: generating sample images at step / サンプル画像生成 ステップ: 3\n",
                 "generating sample images at step / サンプル画像生成 ステップ: 3 more\n"):
        assert parsed(text.encode()).progress.passes == []
    assert parsed(PASS.format(step=3).encode()).progress.passes == [(3, 0)]


# -- the watchdog and the ETA ----------------------------------------------------------------------------------------

def test_a_pass_has_its_own_stall_limit_and_its_bar_is_life_there():
    """Training's limit counts new steps only; a pass's counts any output (its bar moves), against its own limit."""
    parser = Parser()
    dog = Watchdog({**DEFAULT_STALL_LIMITS_S, "training": 60.0, "sampling": 900.0}, 0.0)
    for t, text in ((0.0, BAR.format(pct=33, n=2)), (1.0, PASS.format(step=2)), *((10.0 * i, SAMPLER)
                                                                                   for i in range(2, 80))):
        before = (parser.progress.phase, parser.progress.step)
        parser.feed(text)
        dog.saw_output(*before, parser.progress, t)
    assert parser.progress.phase is Phase.SAMPLING and dog.check(Phase.SAMPLING, 800.0) is None  # 790 s of pass
    assert "no progress in sampling" in str(dog.check(Phase.SAMPLING, 790.0 + 901.0))
    assert DEFAULT_STALL_LIMITS_S["sampling"] >= 600


def test_the_eta_takes_the_passes_off_the_steps_clock_and_counts_those_left_at_their_cost():
    """400 steps at 1 s each, a pass every 100 steps taking 30 s (and one before the first step): at step 150 the
    steps left are 250 s at the step rate the passes did not slow, and the passes left (200, 300, 400) 90 s."""
    eta = EtaClock(400, estimated_duration_s=None, tail_s=10.0, sample_every=100)
    eta.follow(Phase.SAMPLING, 0, 0.0)  # the pass before the first step
    eta.follow(Phase.TRAINING, 0, 30.0)
    t = 30.0
    for step in range(1, 151):
        t += 1.0
        eta.follow(Phase.TRAINING, step, t)
        if step == 100:
            eta.follow(Phase.SAMPLING, 100, t)
            t += 30.0
            eta.follow(Phase.SAVING, 100, t)
    assert eta.passes_s == [30.0, 30.0] and eta.rate() == pytest.approx(1.0)
    left, basis = eta.eta(Phase.TRAINING, t, elapsed_s=t)
    assert basis == "measured" and left == pytest.approx(250 + 3 * 30 + 10.0)
    eta.observe(200, t + 50.0)  # step 200's pass, 10 s in: its 20 s left, then the two after it
    eta.follow(Phase.SAMPLING, 200, t + 50.0)
    left, _ = eta.eta(Phase.SAMPLING, t + 60.0, elapsed_s=t + 60.0)
    assert left == pytest.approx(200 + 20 + 2 * 30 + 10.0)


def test_without_samples_or_before_a_pass_is_measured_the_eta_counts_no_pass():
    for eta in (EtaClock(400, None, tail_s=10.0), EtaClock(400, None, tail_s=10.0, sample_every=100)):
        eta.follow(Phase.TRAINING, 0, 0.0)
        for step in range(1, 51):
            eta.follow(Phase.TRAINING, step, float(step))
        assert eta.eta(Phase.TRAINING, 50.0, 50.0)[0] == pytest.approx(350 + 10.0)


def test_the_passes_interval_is_read_from_the_jobs_command():
    assert sample_every_of(["--save_every_n_steps=100", "--sample_every_n_steps=100"]) == 100
    assert sample_every_of(["--save_every_n_steps=100"]) == 0


# -- a failure in a pass ---------------------------------------------------------------------------------------------

def test_an_oom_in_a_pass_is_the_oom_and_says_the_steps_lora_was_never_written():
    """The fake trainer's OOM in the pass of step 4 (as sd-scripts: no try/except, the save never comes)."""
    text = (BAR.format(pct=33, n=2) + PASS.format(step=2) + SAMPLER + "\nsaving checkpoint: /o/ohwx-step00000002"
            ".safetensors\n" + BAR.format(pct=66, n=4) + PASS.format(step=4) + "prompt: photo of ohwx dog\n" + SAMPLER
            + "\nTraceback (most recent call last):\n  File \"/sd/library/train_util.py\", line 6553, in "
            "sample_image_inference\n    latents = pipeline(\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
            "allocate 1.50 GiB.\n")
    parser = parsed(text.encode())
    outcome = decide(returncode=1, progress=parser.progress, log_tail=text.replace("\r", "\n").splitlines())
    assert outcome.failure_class is not None and outcome.failure_class.value == "cuda_oom"
    assert "ended in the sample pass of step 4, which runs before that step's save: the step LoRA of step 4 was " \
           "never written (the newest step LoRA is step 2's)" in str(outcome.sentence)


def test_a_run_that_ended_outside_a_pass_says_nothing_of_one():
    text = BAR.format(pct=33, n=2) + PASS.format(step=2) + "\nsaving checkpoint: /o/ohwx-step00000002.safetensors\n"
    outcome = decide(returncode=1, progress=parsed(text.encode()).progress, log_tail=[])
    assert "sample pass" not in str(outcome.sentence)


# -- the images --------------------------------------------------------------------------------------------------

class Job:
    def __init__(self, out: Path, prompts: int = 2) -> None:
        self.output_dir, self.output_name = str(out), "ohwx"
        self.output_dev_ino = str(FileId.of(out.stat()))
        self.sample_prompts = [{"prompt": f"p{i}", "seed": 42 + i} for i in range(prompts)]


@pytest.fixture
def out(tmp_path: Path) -> Path:
    (tmp_path / "output" / "sample").mkdir(parents=True)
    return tmp_path / "output"


def image(out: Path, name: str, size: int = 64) -> Path:
    path = out / "sample" / name
    FAKE.sd_samples.write_png(str(path), size, size, 7)
    return path


def lora_row(step: int) -> CheckpointRow:
    return CheckpointRow(LORA, step, f"/o/ohwx-step{step:08d}.safetensors", utcnow(), 100, "ab" * 32, True)


def taken(job: Job, text: str, ended: bool = False) -> list:
    return Samples(job).take(parsed(text.encode()).progress, ended=ended,
                             lora_of=lambda step: lora_row(step) if step else None)


def test_a_pass_is_over_once_a_steps_redraw_follows_it_and_names_its_step_lora(out):
    for name in ("ohwx_000002_00_20261206051027_42.png", "ohwx_000002_01_20261206051137_43.png",
                 "ohwx_e000000_00_20261206045902_42.png"):
        image(out, name)
    watcher, parser = Samples(Job(out)), Parser()
    parser.feed(BAR.format(pct=33, n=2) + PASS.format(step=2) + SAMPLER)
    assert watcher.take(parser.progress, ended=False, lora_of=lora_row) == []  # under way: its images may be cut
    parser.feed(BAR.format(pct=33, n=2).replace("00:01<", "00:09<"))  # the redraw after its save (set_postfix)
    [one] = watcher.take(parser.progress, ended=False, lora_of=lora_row)
    assert (one.step, one.expected, [(r.prompt_index, r.seed, r.width) for r in one.images]) == (
        2, 2, [(0, 42, 64), (1, 43, 64)])
    assert one.lora is not None and (one.lora["step"], one.lora["verified"]) == (2, True)
    assert watcher.take(parser.progress, ended=False, lora_of=lora_row) == []  # once


def test_the_pass_before_the_first_step_is_the_base_models_and_has_no_step_lora(out):
    image(out, "ohwx_e000000_00_20261206045902_42.png")
    [first] = taken(Job(out, prompts=1), PASS.format(step=0) + BAR.format(pct=0, n=0))
    assert (first.step, len(first.images), first.lora) == (0, 1, None)


@pytest.mark.parametrize("name", [
    "ohwx_000002_00_20261206051027_41.png",  # another seed than the prompt's
    "ohwx_000002_02_20261206051027_44.png",  # a prompt index the job has not
    "ohwx_000003_00_20261206051027_42.png",  # another step's
    "other_000002_00_20261206051027_42.png",  # another output name
    "ohwx_000002_00_20261206051027.png",  # no seed: the worker always gives one
    "ohwx_000002_00_2026120605102_42.png",  # a time of 13 digits
    "ohwx_e000002_00_20261206051027_42.png",  # an epoch pass: the worker samples by steps
    "ohwx_000002_00_20261206051027_42.png.tmp",
])
def test_a_name_that_is_not_one_of_the_passes_images_is_left_out(out, name):
    image(out, name)
    [one] = taken(Job(out), PASS.format(step=2) + BAR.format(pct=33, n=2))
    assert one.images == ()


def test_what_is_not_a_whole_png_of_its_own_is_left_out(out, tmp_path):
    good = image(out, "ohwx_000002_00_20261206051027_42.png")
    cut = image(out, "ohwx_000002_01_20261206051027_43.png", 256)
    cut.write_bytes(cut.read_bytes()[:300])  # a truncated image: its IDAT does not inflate whole
    one = taken(Job(out), PASS.format(step=2) + BAR.format(pct=33, n=2))[0]
    assert [r.name for r in one.images] == [good.name]
    for index, plant in enumerate(("link", "fifo", "huge", "text")):
        target = out / "sample" / f"ohwx_000004_{index:02d}_20261206051027_{42 + index}.png"
        if plant == "link":
            target.symlink_to(good)
        elif plant == "fifo":
            os.mkfifo(target)
        elif plant == "huge":
            with target.open("wb") as fh:
                fh.truncate(MAX_SAMPLE_BYTES + 1)
        else:
            target.write_text("not a png")
    job = Job(out, prompts=4)
    assert taken(job, PASS.format(step=4) + BAR.format(pct=66, n=4))[0].images == ()


def test_a_sample_folder_that_is_a_link_is_not_followed(out, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    image(out, "ohwx_000002_00_20261206051027_42.png")
    shutil.move(out / "sample", elsewhere / "sample")
    (out / "sample").symlink_to(elsewhere / "sample")
    assert taken(Job(out), PASS.format(step=2) + BAR.format(pct=33, n=2))[0].images == ()


def test_of_two_images_of_a_step_and_prompt_the_newest_by_its_name_is_this_runs(out):
    """An earlier run of the job sampled step 2 and died before its save; this run sampled it again."""
    image(out, "ohwx_000002_00_20261206051027_42.png")
    image(out, "ohwx_000002_00_20261206061027_42.png")
    [one] = taken(Job(out, prompts=1), PASS.format(step=2) + BAR.format(pct=33, n=2))
    assert [r.name for r in one.images] == ["ohwx_000002_00_20261206061027_42.png"]


def test_the_real_trainers_image_decodes(out):
    shutil.copy(RIG / "sample-step4-prompt0.png", out / "sample" / "ohwx_000004_00_20261206051215_42.png")
    [one] = taken(Job(out, prompts=1), PASS.format(step=4) + BAR.format(pct=66, n=4))
    assert [(r.width, r.height, r.bytes) for r in one.images] == [(256, 256, 145269)]


def test_at_the_end_a_pass_cut_short_keeps_the_images_it_wrote(out):
    image(out, "ohwx_000004_00_20261206051215_42.png")
    [one] = taken(Job(out), PASS.format(step=4), ended=True)
    assert (one.step, len(one.images), one.expected) == (4, 1, 2)

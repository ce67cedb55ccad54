"""The progress parser against byte-exact captures of real sd-scripts runs (tests/data/*.jsonl)."""
from __future__ import annotations

import base64
import json
import math
import random
import re._constants as sre_constants
import re._parser as sre_parse

import pytest

from lora_worker.states import Phase
from lora_worker.transcript.markers import MARKER_GUARD, MARKERS
from lora_worker.transcript.parser import Decoder, Parser
from tests.helpers import DATA


def chunks(name: str) -> list[tuple[str, bytes]]:
    lines = (DATA / f"{name}.jsonl").read_text().splitlines()[1:]
    return [(c["stream"], base64.b64decode(c["b64"])) for c in map(json.loads, lines)]


def replay(items: list[tuple[str, bytes]], parser: Parser | None = None) -> tuple[Parser, list[Phase]]:
    parser = parser or Parser()
    decoder = Decoder()
    phases = [parser.progress.phase]
    for _stream, data in items:  # captured from two pipes; the supervisor reads one, in arrival order
        parser.feed(decoder.decode(data))
        if parser.progress.phase is not phases[-1]:
            phases.append(parser.progress.phase)
    parser.close()
    return parser, phases


def test_a_real_successful_run_gives_steps_loss_rate_eta_and_every_phase():
    parser, phases = replay(chunks("run1_simple"))
    p = parser.progress
    assert (p.step, p.total_steps, p.loss) == (3, 3, 0.984)
    assert p.rate == pytest.approx(1 / 11.35) and p.eta_s == 0.0
    assert "model_saved" in p.flags and p.checkpoints == ["/worktank/arbo/train/t1/output/run1/ohwx.safetensors"]
    assert phases == [Phase.LAUNCHING, Phase.LOADING_MODEL, Phase.CACHING_LATENTS,
                      Phase.CACHING_TEXT_ENCODER_OUTPUTS, Phase.PREPARING_TRAINING, Phase.TRAINING, Phase.SAVING]


def test_the_loss_curve_keeps_the_latest_loss_of_each_step():
    parser, _ = replay(chunks("run1_simple"))
    # the first redraw of step 2 repeats step 1's loss; the second carries the new one
    assert parser.take_points() == [(1, 1.07), (2, 1.08), (3, 0.984)]


def test_mid_run_saves_go_back_to_training_and_are_not_the_final_save():
    parser, phases = replay(chunks("run5_epochs_saves"))
    p = parser.progress
    assert (p.step, p.total_steps) == (12, 12)
    assert [c.rsplit("/", 1)[1] for c in p.checkpoints] == [
        "ohwx-step00000005.safetensors", "ohwx-000001.safetensors", "ohwx-step00000010.safetensors",
        "ohwx.safetensors"]
    assert phases.count(Phase.SAVING) == 4 and phases[-1] is Phase.SAVING
    assert phases[phases.index(Phase.SAVING) + 1] is Phase.TRAINING


def test_mid_stream_progress_is_visible_before_the_run_ends():
    items = chunks("run1_simple")
    first_step = next(i for i, (s, d) in enumerate(items) if b"steps:" in d and b"1/3" in d)
    parser, _ = replay(items[: first_step + 1])
    assert parser.progress.step == 1 and parser.progress.phase is Phase.TRAINING


@pytest.mark.parametrize("name, flag", [("fail_empty_dataset", "no_data"), ("fail_missing_model", "model_load_error"),
                                        ("fail_empty_caption", "caption_invalid")])
def test_failure_markers_of_real_failed_runs(name, flag):
    parser, _ = replay(chunks(name))
    assert flag in parser.progress.flags
    assert "model_saved" not in parser.progress.flags


def test_the_launchers_report_of_the_trainers_status_is_read():
    parser, _ = replay(chunks("fail_missing_model"))
    assert parser.progress.inner_exit == 1


def test_a_run_killed_mid_bar_ends_on_an_unterminated_redraw_that_still_counts():
    items = chunks("cancel_b_group")
    assert items[-1][0] == "stdout" and not any(d.endswith(b"\n") for s, d in items[-3:] if s == "stderr")
    parser, phases = replay(items)
    assert (parser.progress.step, parser.progress.total_steps) == (0, 50)
    assert phases[-1] is Phase.TRAINING


def test_any_chunking_gives_the_same_result():
    items = chunks("run5_epochs_saves")
    whole = {s: b"".join(d for st, d in items if st == s) for s in ("stdout", "stderr")}
    reference, _ = replay(items)
    rng = random.Random(7)
    for _ in range(5):
        cut_items = []
        for stream, data in whole.items():
            pos = 0
            while pos < len(data):
                step = rng.randint(1, 40)
                cut_items.append((stream, data[pos:pos + step]))
                pos += step
        # streams interleave in arrival order in reality; here stdout before stderr is enough for totals
        parser, _ = replay(cut_items)
        p, r = parser.progress, reference.progress
        assert (p.step, p.total_steps, p.loss, p.flags, p.checkpoints) == (
            r.step, r.total_steps, r.loss, r.flags, r.checkpoints)


def test_a_redraw_glued_to_a_rich_log_line_is_read_as_both():
    parser = Parser()
    parser.feed("\rsteps: 100%|██████████| 2/2 [00:19<00:00,  9.87s/it, avr_loss=1.08]"
                          "2026-11-30 03:36:26 INFO     model saved.        train_network.py:1729\n")
    p = parser.progress
    assert (p.step, p.total_steps, p.loss) == (2, 2, 1.08) and "model_saved" in p.flags


def test_a_redraw_and_its_close_split_across_reads():
    parser = Parser()
    parser.feed("\rsteps:  50%|█████     | 1/2 [00:03<00:03,  3.63s/it, avr_loss=1.07]")
    assert parser.progress.step == 1  # a complete redraw counts before its line ends
    parser.feed("\n")
    assert parser.progress.step == 1


def test_nan_loss_and_padding():
    parser = Parser()
    parser.feed("\rsteps:  33%|███▎      | 4/12 [00:15<00:31,  3.88s/it, avr_loss=nan] ")
    assert math.isnan(parser.progress.loss)
    parser.feed("\rsteps:  42%|████▏     | 5/12 [00:19<00:27,  3.90s/it, avr_loss=1.02] ")
    assert parser.progress.loss == 1.02 and parser.progress.eta_s == 27.0


def test_it_per_second_and_hour_long_etas():
    parser = Parser()
    parser.feed("\rsteps:  45%|████▌     | 765/1700 [09:44<1:11:54,  1.31it/s, avr_loss=0.0871]")
    p = parser.progress
    assert (p.rate, p.eta_s) == (1.31, 4314.0)


def test_ansi_escapes_are_ignored():
    parser = Parser()
    decoder = Decoder()
    parser.feed(decoder.decode(b"\x1b[A\rsteps:  10%|\x1b[1m#   \x1b[0m| 1/10 [00:01<00:09,"
                               b"  1.00s/it, avr_loss=0.5]"))
    assert parser.progress.step == 1


def test_other_bars_do_not_move_the_steps():
    parser = Parser()
    parser.feed("\rread caption: 100%|██████████| 3/3 [00:00<00:00, 23087.91it/s]\n"
                "\rvalidation steps: 100%|██████████| 9/9 [00:01<00:00, 5.0it/s]\n")
    assert parser.progress.step == 0 and parser.progress.total_steps is None


def test_utf8_split_between_chunks_is_decoded_whole():
    decoder = Decoder()
    text = "no regularization images / 正則化画像が見つかりませんでした\n".encode()
    out = "".join(decoder.decode(text[i:i + 1]) for i in range(len(text)))
    assert out == text.decode()


def _always_guarded(items: object, guard: str) -> bool:
    """Whether every string the parsed pattern `items` matches holds a character of `guard`."""
    for op, av in items:  # type: ignore[attr-defined]
        if op is sre_constants.LITERAL and chr(av) in guard:
            return True
        if op is sre_constants.SUBPATTERN and _always_guarded(av[-1], guard):
            return True
        if op is sre_constants.BRANCH and all(_always_guarded(alt, guard) for alt in av[1]):
            return True
    return False


def test_every_marker_holds_a_guard_character_and_no_steps_redraw_does():
    # What lets the parser and the decoder skip redraws without ever missing a marker.
    assert _always_guarded(sre_parse.parse(MARKERS.pattern), MARKER_GUARD)
    redraws = [d for s, d in chunks("run5_epochs_saves") + chunks("run1_simple") if d.startswith(b"\rsteps:")]
    assert redraws and not any(g.encode() in d for d in redraws for g in MARKER_GUARD)


# -- the trainer's text is data ----------------------------------------------------------------------------------

# A name anyone who writes a dataset can choose: every marker phrase the parser knows, in one path component.
HOSTILE = ("x model saved. caching Text Encoder outputs... CUDA out of memory torch.OutOfMemoryError: CUDA out of"
           " memory. saving checkpoint: died with <Signals.SIGKILL: 9>. No data found. Please verify arguments")


def summary(parser: Parser, phases: list[Phase]) -> tuple[object, ...]:
    p = parser.progress
    return (phases, p.step, p.total_steps, sorted(p.flags), p.signal, p.inner_exit, len(p.checkpoints))


@pytest.mark.parametrize("name", ["run1_simple", "run5_epochs_saves", "fail_missing_model", "fail_empty_caption",
                                  "cancel_b_group"])
def test_a_path_or_train_id_holding_every_marker_changes_nothing(name):
    items = chunks(name)
    # The train ids, the kohya folder and the output name, wherever the run echoes them (log lines, the saved
    # path, tracebacks, the launcher's report of the command).
    names = [(b"/train/t1/", f"/train/t1{HOSTILE}/".encode()), (b"/train/t2/", f"/train/t2{HOSTILE}/".encode()),
             (b"2_ohwx dog", f"2_ohwx dog{HOSTILE}".encode()), (b"/ohwx", f"/ohwx{HOSTILE}".encode())]
    rewritten = items
    for plain, evil in names:
        rewritten = [(s, d.replace(plain, evil)) for s, d in rewritten]
    assert rewritten != items  # the names really are echoed by the run
    assert summary(*replay(rewritten)) == summary(*replay(items))


def test_a_caption_or_message_quoting_markers_inside_a_line_changes_nothing():
    lines = [f"caption: {HOSTILE}", f"found directory /worktank/arbo/train/{HOSTILE}/dataset contains 3 image files",
             f"FileNotFoundError: [Errno 2] No such file or directory: '/worktank/{HOSTILE}/img.txt'",
             f'  File "/worktank/{HOSTILE}/x.py", line 3, in <module>',
             f"2026-11-30 03:36:26 INFO     found directory {HOSTILE}        train_util.py:1",
             "    assert len(lines) > 0, f\"caption file is empty / {cap_path}\"",
             "ValueError: not CUDA out of memory, model saved."]
    parser, phases = replay([("output", ("\n".join(lines) + "\n").encode())])
    assert summary(parser, phases) == ([Phase.LAUNCHING], 0, None, [], None, None, 0)


def test_an_assertion_quoting_the_text_encoder_cache_does_not_move_the_phase():
    # Real run fail_te_cache_combo: the trainer fails before loading the model, its message names the phase.
    text = ("Traceback (most recent call last):\n"
            '  File "/opt/fluxgym/sd-scripts/train_network.py", line 468, in train\n'
            "    assert (\n"
            "AssertionError: network for Text Encoder cannot be trained with caching Text Encoder outputs / "
            "Text Encoderの出力をキャッシュしながらText Encoderのネットワークを学習することはできません\n")
    parser, phases = replay([("output", text.encode())])
    assert phases == [Phase.LAUNCHING] and parser.progress.flags == set()


def test_a_whole_marker_line_still_counts_plain_indented_glued_or_rich():
    lines = [
        "caching latents...\n",
        "\r  0%|          | 0/3 [00:00<?, ?it/s]caching Text Encoder outputs...\n",
        "\r0it [00:00, ?it/s]No data found. Please verify arguments (train_data_dir must be the parent …)\n",
        "                    INFO     import network module: networks.lora          train_network.py:312\n",
        "  total optimization steps / 学習ステップ数: 12\n",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.\n",
        "subprocess.CalledProcessError: Command '['/v/python', 'x.py', '--output_name=a died with "
        "<Signals.SIGKILL: 9>.']' returned non-zero exit status 1.\n"]
    parser, phases = replay([("output", line.encode()) for line in lines])
    assert phases == [Phase.LAUNCHING, Phase.CACHING_LATENTS, Phase.CACHING_TEXT_ENCODER_OUTPUTS,
                      Phase.PREPARING_TRAINING]
    p = parser.progress
    assert (p.total_steps, p.flags, p.inner_exit, p.signal) == (12, {"no_data", "cuda_oom", "inner_exit"}, 1, None)


def test_model_saved_before_its_saving_checkpoint_line_still_gives_phase_saving():
    # Rich logging without PYTHONUNBUFFERED: the logger's line (stderr, unbuffered) reaches the pipe before the
    # block-buffered `saving checkpoint:` print, which only comes out at exit (docs/reference/sd-scripts.md).
    bar = "\rsteps: 100%|██████████| 12/12 [00:47<00:00,  3.99s/it, avr_loss=0.913]"
    parser, phases = replay([
        ("stderr", bar.encode()),
        ("stderr", b"2026-11-30 03:36:26 INFO     model saved.          train_network.py:1729\n"),
        ("stderr", (bar + "\n").encode()),
        ("stdout", b"\nepoch 1/1\n\n\nsaving checkpoint: /worktank/arbo/train/t1/output/ohwx.safetensors\n"),
    ])
    assert phases == [Phase.LAUNCHING, Phase.TRAINING, Phase.SAVING]
    assert "model_saved" in parser.progress.flags
    assert parser.progress.checkpoints == ["/worktank/arbo/train/t1/output/ohwx.safetensors"]

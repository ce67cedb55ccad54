"""How a run ended: `succeeded` needs exit 0, `model saved.` and a verified LoRA; a failure names its cause first.

The failures are the real ones: the captures and run logs in tests/data, replayed as the supervisor keeps their
last lines, and the failure table of docs/reference/sd-scripts-failures.md for the runs not captured.
"""
from __future__ import annotations

import ast
import base64
import json
import re

import pytest
from sqlalchemy import update

from lora_worker.config import REPO_ROOT

from lora_worker.host.safetensors import ArtifactCheck, ExpectedLora
from lora_worker.transcript.explain import explain, quotable
from lora_worker.ledger import repository as repo
from lora_worker.ledger.models import Job
from lora_worker.ledger.repository import FAILURE_MAX_CHARS
from lora_worker.run.local import launch_supervisor
from lora_worker.transcript.outcome import decide, recorded_lora
from lora_worker.transcript.parser import Progress
from lora_worker.states import TERMINAL_STATES, FailureClass, JobState
from tests.helpers import DATA, set_modes, wait_for

TERMINAL = {s.value for s in TERMINAL_STATES}

OK = ArtifactCheck("/out/x.safetensors")
LAUNCHER = [  # what accelerate's simple_launcher adds after any failed trainer (the real one, shortened argv)
    "Traceback (most recent call last):",
    '  File "/opt/fluxgym/.venv/bin/accelerate", line 8, in <module>',
    "    sys.exit(main())",
    '  File "/opt/fluxgym/.venv/lib/python3.11/site-packages/accelerate/commands/launch.py", line 795, in '
    "simple_launcher",
    "    raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)",
    "subprocess.CalledProcessError: Command '['/opt/fluxgym/.venv/bin/python3', 'sdxl_train_network.py', "
    "'--pretrained_model_name_or_path=/worktank/models/sdxl.safetensors', '--console_log_simple']' returned "
    "non-zero exit status 1.",
]


def progress(*flags: str, signal: int | None = None) -> Progress:
    return Progress(flags=set(flags), signal=signal)


def tail_lines(text: str) -> list[str]:
    """The output's lines as the supervisor keeps them: each line's last `\\r` redraw, no blank lines."""
    lines = (line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n"))
    return [line for line in lines if line.strip()][-200:]


def capture(name: str) -> tuple[int, list[str]]:
    """A .jsonl capture as one merged pipe (chunks in arrival order), and its exit status."""
    rows = (DATA / f"{name}.jsonl").read_text().splitlines()
    chunks = sorted((json.loads(r) for r in rows[1:]), key=lambda c: c["t"])
    data = b"".join(base64.b64decode(c["b64"]) for c in chunks)
    return json.loads(rows[0])["meta"]["rc"], tail_lines(data.decode("utf-8", "replace"))


def run_log(name: str) -> list[str]:
    return tail_lines((DATA / name).read_text())


# -- success -----------------------------------------------------------------------------------------------------

def test_success_needs_all_three():
    rc, tail = capture("run1_simple")
    assert rc == 0
    done = decide(returncode=0, progress=progress("model_saved"), log_tail=tail, artifact=OK)
    assert (done.state, done.lora_path, done.error) == (JobState.SUCCEEDED, OK.path, None)
    no_line = decide(returncode=0, progress=progress(), log_tail=tail, artifact=OK)
    assert (no_line.state, no_line.failure_class) == (JobState.FAILED, FailureClass.NO_OUTPUT)
    missing = decide(returncode=0, progress=progress("model_saved"), log_tail=tail,
                     artifact=ArtifactCheck("/out/x.safetensors", problem="file not found", missing=True))
    assert missing.failure_class is FailureClass.NO_OUTPUT and missing.lora_path is None


# -- the real failures ---------------------------------------------------------------------------------------------

def test_a_model_missing_keys_is_a_model_load_error_that_starts_with_the_runtime_error():
    tail = run_log("fail_model_missing_keys.log")
    real_keys = next(line for line in tail if "Missing key(s) in state_dict" in line).count('", "') + 1
    failed = decide(returncode=1, progress=progress(), log_tail=tail)
    assert failed.failure_class is FailureClass.MODEL_LOAD_ERROR
    first = failed.error.split("\n")[0]
    assert first == failed.sentence
    assert first.startswith("RuntimeError: Error(s) in loading state_dict for SdxlUNet2DConditionModel: "
                            'Missing key(s) in state_dict: "output_blocks.8.0.skip_connection.weight", ')
    assert first.endswith(f"({real_keys} keys) — sd-scripts could not load the base model (exit status 1).")
    assert real_keys > 1000
    assert len(failed.error) <= FAILURE_MAX_CHARS


def test_hollow_tokenizers_are_tokenizer_invalid_named_by_the_overflow_error():
    failed = decide(returncode=1, progress=progress(), log_tail=run_log("fail_tokenizer_hollow.log"))
    assert failed.failure_class is FailureClass.TOKENIZER_INVALID
    assert failed.error.startswith("OverflowError: cannot fit 'int' into an index-sized integer — "
                                   "the CLIP tokenizers are broken")


@pytest.mark.parametrize("name, failure, first_line", [
    ("fail_missing_model", FailureClass.MODEL_LOAD_ERROR,
     'ValueError: The provided pretrained_model_name_or_path "/worktank/models/does_not_exist.safetensors" is '
     "neither a valid local path nor a valid repo id. Please check the parameter."),
    ("fail_empty_caption", FailureClass.DATASET_INVALID,
     "AssertionError: caption file is empty / キャプションファイルが空です: "
     "/worktank/arbo/train/t2/dataset/2_ohwx dog/img2.txt"),
    ("fail_empty_dataset", FailureClass.DATASET_INVALID,  # exit 0, no traceback: sd-scripts' own line
     "No data found. Please verify arguments (train_data_dir must be the parent of folders with images) / "
     "画像がありません。引数指定を確認してください（train_data_dirには画像があるフォルダではなく、"
     "画像があるフォルダの親フォルダを指定する必要があります）"),
])
def test_each_captured_failure_is_classed_and_starts_with_its_line_in_full(name, failure, first_line):
    rc, tail = capture(name)
    failed = decide(returncode=rc, progress=progress(), log_tail=tail)
    assert (failed.state, failed.failure_class) == (JobState.FAILED, failure)
    assert failed.error.split("\n")[0].startswith(first_line + " — ")
    assert failed.sentence and failed.error.startswith(failed.sentence)


def test_a_trainer_killed_by_a_signal_says_so_with_the_last_lines():
    rc, tail = capture("cancel_b_group")
    assert rc == -15
    killed = decide(returncode=rc, progress=progress(), log_tail=tail)
    assert killed.failure_class is FailureClass.KILLED_BY_SIGNAL and (killed.exit_code, killed.signal) == (None, 15)
    assert killed.error.startswith("The trainer was killed by SIGTERM.\n\n")
    assert killed.error.endswith(tail[-1])


def traceback(*frames: str, exception: str) -> list[str]:
    lines = ["Traceback (most recent call last):"]
    for frame in frames:
        path, func = frame.split(":")
        lines += [f'  File "{path}", line 10, in {func}', "    call()"]
    return lines + [exception]


@pytest.mark.parametrize("lines, failure, first_line", [
    # fail_no_tokenizer_offline: an empty tokenizer cache offline; stdout empty, transformers' TypeError
    (traceback("/opt/fluxgym/sd-scripts/library/strategy_base.py:_load_tokenizer",
               "/opt/fluxgym/.venv/lib/python3.11/site-packages/transformers/models/clip/tokenization_clip.py:__init__",
               exception="TypeError: expected str, bytes or os.PathLike object, not NoneType"),
     FailureClass.TOKENIZER_MISSING, "TypeError: expected str, bytes or os.PathLike object, not NoneType"),
    # fail_unknown_flag: argparse's own line (exit 2 inside), after a long usage message
    (["usage: sdxl_train_network.py [-h] [--console_log_level {DEBUG,INFO,WARNING,ERROR,CRITICAL}]",
      "                             [--console_log_file CONSOLE_LOG_FILE]",
      "sdxl_train_network.py: error: unrecognized arguments: --text_encoder_lr1=1e-5"],
     FailureClass.INVALID_ARGUMENTS, "sdxl_train_network.py: error: unrecognized arguments: --text_encoder_lr1=1e-5"),
    # fail_te_cache_combo: sd-scripts' own argument check
    (traceback("/opt/fluxgym/sd-scripts/sdxl_train_network.py:assert_extra_args",
               exception="AssertionError: network for Text Encoder cannot be trained with caching Text Encoder "
                         "outputs / Text Encoderの出力をキャッシュしながら"
                         "Text Encoderのネットワークを学習することはできません"),
     FailureClass.INVALID_ARGUMENTS, "AssertionError: network for Text Encoder cannot be trained with caching Text "
     "Encoder outputs / Text Encoderの出力をキャッシュしながらText Encoderのネットワークを学習することはできません"),
    # fail_model_repoid_offline
    (traceback("/opt/fluxgym/sd-scripts/library/sdxl_train_util.py:_load_target_model",
               exception="OSError: Cannot load model stabilityai/stable-diffusion-xl-base-1.0: model is not cached "
                         "locally and an error occurred while trying to fetch metadata from the Hub."),
     FailureClass.MODEL_LOAD_ERROR, "OSError: Cannot load model stabilityai/stable-diffusion-xl-base-1.0: model is "
     "not cached locally and an error occurred while trying to fetch metadata from the Hub."),
    # fail_bad_output_dir: the traceback glued onto the last bar redraw; no known class, named by its line
    (["steps: 100%|██████████| 2/2 [00:20<00:00, 10.1s/it, avr_loss=1.08]Traceback (most recent call last):",
      '  File "/opt/fluxgym/sd-scripts/train_network.py", line 1297, in train',
      "    os.makedirs(args.output_dir, exist_ok=True)",
      "NotADirectoryError: [Errno 20] Not a directory: '/opt/rig/install.log/out'"],
     FailureClass.TRAINER_CRASHED, "NotADirectoryError: [Errno 20] Not a directory: '/opt/rig/install.log/out'"),
    # torch >= 2.5 on a CUDA host
    (traceback("/opt/fluxgym/sd-scripts/train_network.py:train",
               exception="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
                         "capacity of 23.57 GiB of which 11.06 MiB is free."),
     FailureClass.CUDA_OOM, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
     "total capacity of 23.57 GiB of which 11.06 MiB is free."),
])
def test_the_documented_failures_are_classed_from_their_line(lines, failure, first_line):
    failed = decide(returncode=1, progress=progress("inner_exit"), log_tail=["epoch 1/1", *lines, *LAUNCHER])
    assert failed.failure_class is failure
    assert failed.error.split("\n")[0].startswith(first_line + " — ")


# -- what the error quotes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fail_model_missing_keys.log", "fail_tokenizer_hollow.log"])
def test_the_error_never_quotes_the_launchers_argv_dump(name):
    tail = run_log(name)
    assert any(line.startswith("subprocess.CalledProcessError: Command '[") for line in tail)
    failed = decide(returncode=1, progress=progress(), log_tail=tail)
    assert "CalledProcessError" not in failed.error and "--pretrained_model_name_or_path" not in failed.error
    assert "accelerate/commands/launch.py" not in failed.error
    assert failed.log_lines and failed.error.endswith(failed.log_lines[-1])


def test_a_very_long_line_is_shortened_so_the_log_still_shows_its_end():
    tail = run_log("fail_model_missing_keys.log")
    assert max(map(len, tail)) > 90_000
    failed = decide(returncode=1, progress=progress(), log_tail=tail)
    assert max(map(len, failed.log_lines)) <= 500
    assert "raise RuntimeError(" in failed.error  # the trainer's frames before the error line still fit


def test_the_error_keeps_its_head_whole_and_the_end_of_a_long_log():
    lines = [f"line {i} " + "x" * 300 for i in range(100)]
    error = decide(returncode=1, progress=progress(), log_tail=lines).error or ""
    assert len(error) <= FAILURE_MAX_CHARS and error.startswith("The trainer failed (exit status 1).\n\n")
    assert error.endswith(lines[-1])


# -- whole lines only ---------------------------------------------------------------------------------------------

HOSTILE = "/worktank/arbo/train/torch.OutOfMemoryError: CUDA out of memory/caption file is empty/No data found. " \
          "Please verify arguments (train_data_dir must be the parent of folders with images)"


def test_text_that_merely_contains_a_marker_classes_nothing():
    lines = [f"found directory {HOSTILE} contains 3 image files", f"load tokenizer from cache: {HOSTILE}",
             "  File \"x\", line 1, in read_caption", "epoch 1/1"]
    crashed = decide(returncode=1, progress=progress(), log_tail=lines)
    assert crashed.failure_class is FailureClass.TRAINER_CRASHED
    assert decide(returncode=0, progress=progress(), log_tail=lines).failure_class is FailureClass.NO_OUTPUT


def test_a_marker_quoted_inside_an_exception_message_does_not_change_its_class():
    lines = traceback("/opt/fluxgym/sd-scripts/library/train_util.py:read_caption",
                      exception="AssertionError: caption file is empty / "
                                f"キャプションファイルが空です: {HOSTILE}/1.txt")
    assert decide(returncode=1, progress=progress(), log_tail=lines).failure_class is FailureClass.DATASET_INVALID
    quoted = traceback("/opt/fluxgym/sd-scripts/train_network.py:train",
                       exception="RuntimeError: the prompt 'caching Text Encoder outputs, CUDA out of memory' failed")
    assert decide(returncode=1, progress=progress(), log_tail=quoted).failure_class is FailureClass.TRAINER_CRASHED


def test_traceback_shaped_text_before_the_real_crash_is_not_its_explanation():
    injected = traceback("x:read_caption", exception="AssertionError: caption file is empty / planted")
    real = traceback("/opt/fluxgym/sd-scripts/train_network.py:train",
                     exception="RuntimeError: CUDA error: an illegal memory access was encountered")
    crashed = decide(returncode=1, progress=progress(), log_tail=[*injected, "epoch 1/1", *real, *LAUNCHER])
    assert crashed.failure_class is FailureClass.TRAINER_CRASHED
    assert crashed.error.startswith("RuntimeError: CUDA error: an illegal memory access was encountered — "
                                    "the trainer failed (exit status 1).\n")


def test_a_chained_exception_is_classed_by_its_strongest_link():
    cause = traceback("/opt/fluxgym/sd-scripts/train_network.py:train",
                      exception="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
    during = traceback("/opt/fluxgym/sd-scripts/train_network.py:train", exception="RuntimeError: cleanup failed")
    lines = [*cause, "During handling of the above exception, another exception occurred:", *during, *LAUNCHER]
    assert decide(returncode=1, progress=progress(), log_tail=lines).failure_class is FailureClass.CUDA_OOM


def test_an_interrupt_in_the_tokenizer_is_the_signal_not_a_broken_tokenizer():
    lines = traceback("/opt/fluxgym/sd-scripts/library/strategy_base.py:_get_input_ids", exception="KeyboardInterrupt")
    interrupted = decide(returncode=-2, progress=progress(), log_tail=lines)
    assert interrupted.failure_class is FailureClass.KILLED_BY_SIGNAL
    assert explain(lines) is not None and explain(lines).failure is None


def test_quotable_lines_keep_everything_but_the_launchers_traceback():
    lines = ["epoch 1/1", *traceback("a.py:train", exception="ValueError: x"), *LAUNCHER]
    assert quotable(lines) == lines[: -len(LAUNCHER)]


# -- exit status, artifacts, cancel, stall -------------------------------------------------------------------------

def test_exit_code_and_signal_are_kept_apart():
    killed = decide(returncode=-15, progress=progress(), log_tail=[])
    assert (killed.exit_code, killed.signal) == (None, 15)
    launcher = decide(returncode=1, progress=progress("died", signal=9), log_tail=[])
    assert (launcher.exit_code, launcher.signal) == (1, 9)
    assert launcher.failure_class is FailureClass.KILLED_BY_SIGNAL


def test_a_mismatched_or_unreadable_artifact_is_not_success():
    bad = decide(returncode=0, progress=progress("model_saved"), log_tail=[],
                 artifact=ArtifactCheck("/o", problem="rank [8] instead of 16", mismatch=True))
    assert (bad.state, bad.failure_class) == (JobState.FAILED, FailureClass.ARTIFACT_MISMATCH)
    broken = decide(returncode=0, progress=progress("model_saved"), log_tail=[],
                    artifact=ArtifactCheck("/o", problem="truncated"))
    assert broken.failure_class is FailureClass.ARTIFACT_INVALID and broken.lora_path is None


def test_cancel_and_stall_win_over_whatever_the_exit_said():
    tail = run_log("fail_tokenizer_hollow.log")
    assert decide(returncode=-15, progress=progress(), log_tail=tail, cancelled=True).state is JobState.CANCELLED
    stalled = decide(returncode=-15, progress=progress(), log_tail=tail, stalled_in="loading_model")
    assert stalled.failure_class is FailureClass.STALLED and re.match(r"No progress in phase loading_model",
                                                                      stalled.error or "")


# -- the artifact is held to what dispatch recorded ---------------------------------------------------------------

def test_the_expected_lora_is_read_from_the_row():
    job = Job(output_name="ohwx", seed=7, lora_rank=8, lora_steps=123, lora_dtype="BF16", tier="fast")
    assert recorded_lora(job) == ExpectedLora(rank=8, output_name="ohwx", steps=123, seed=7, dtype="BF16",
                                              trained_steps=123)
    assert recorded_lora(Job(output_name="o", seed=1, lora_rank=4, lora_steps=3, lora_dtype="F16",
                             output_dev_ino="12:34")).output_dir_id is not None


def test_the_run_never_reads_the_tier_or_dtype_constants():
    # Re-deriving the expectation at the end of a run would judge an old job by today's constants.
    run = REPO_ROOT / "lora_worker" / "run"
    for path in sorted(run.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lora_worker.config":
                names = {a.name for a in node.names}
                assert not names & {"TIERS", "Tier", "LORA_DTYPE"}, f"{path.name} imports {names}"
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("TIERS", "LORA_DTYPE"), f"{path.name}:{node.lineno}"


def run_recorded(api, host, db, **recorded: object) -> Job:
    """Accept a job as dispatch does, change what its row expects, then let the real supervisor run it."""
    job_id = api.post("/train", json=host.payload()).get_json()["worker_job_id"]
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id).values(**recorded))
    launch_supervisor(job_id, host.settings)
    return wait_for(lambda: (j := repo.get_job(db, job_id)).status in TERMINAL and j, timeout=60,
                    what=f"job {job_id} to end")


@pytest.mark.slow
def test_a_lora_that_matches_the_row_succeeds_though_the_tier_says_otherwise(api, host, db):
    set_modes(host.sd_scripts, rank_override=8)  # the fast tier means rank 16; the row says 8
    done = run_recorded(api, host, db, lora_rank=8)
    assert (done.status, done.failure_class, done.lora_path) == ("succeeded", None, done.lora_file), done.error


@pytest.mark.slow
def test_a_lora_saved_in_another_dtype_than_recorded_is_a_mismatch(api, host, db):
    done = run_recorded(api, host, db, lora_dtype="F32")  # the argv says fp16: sd-scripts (and the fake) save F16
    assert (done.status, done.failure_class) == ("failed", "artifact_mismatch")
    assert "tensors of another dtype than F32" in (done.error or "")

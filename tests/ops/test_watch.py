"""`lora-worker jobs watch [ID]`: a live view redrawn in place at a terminal, plain lines through a pipe, and
the outcome at the end; `jobs show` draws the same loss sparkline."""
from __future__ import annotations

from collections.abc import Callable

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from lora_worker.ops.cli import build_parser
from lora_worker.ops.jobs import run
from lora_worker.ops.watch import BLOCKS, describe_curve, sparkline
from lora_worker.states import JobState
from tests.helpers import set_modes
from tests.helpers.cli import finished
from tests.helpers.service import settings_env

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PHASES = ["launching", "loading_model", "caching_latents", "caching_text_encoder_outputs", "preparing_training",
          "training", "sampling", "saving"]


def lora_worker(*argv: str) -> list[str]:
    return [str(Path(sys.executable).parent / "lora-worker"), *argv]


def in_a_terminal(argv: list[str], env: dict[str, str], columns: int = 100, rows: int = 40,
                  timeout: float = 120, on_output: Callable[[bytes], None] = lambda screen: None) -> tuple[int, str]:
    """Run `argv` with its stdout on a pseudo-terminal of the given size; its stderr (log lines) apart.
    `on_output` sees each read's bytes, with the previous read's last 32 before them (a marker cut in two)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE,
                            env={**env, "TERM": "xterm-256color"})
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                return
            if not data:
                return
            on_output((chunks[-1][-32:] if chunks else b"") + data)
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    proc.wait(timeout)
    reader.join(10)
    os.close(master)
    assert proc.stderr is not None
    proc.stderr.close()
    return proc.returncode, b"".join(chunks).decode("utf-8", "replace")


def in_order(phases: list[str]) -> bool:
    """The phases only move forward, but for a sample pass or a step save that training follows (a pass before the
    first step and at each save, a checkpoint every SAVE_EVERY_N_STEPS steps: the job is back in `training` at the
    next redraw)."""
    forward = [p for i, p in enumerate(phases)
               if not (p in ("sampling", "saving") and "training" in phases[i + 1:])]
    return [PHASES.index(p) for p in forward] == sorted(PHASES.index(p) for p in forward)


def frames_of(screen: str) -> tuple[list[str], list[str]]:
    """The output cut at each panel's top edge: [what came before each frame], [each frame, escapes stripped]."""
    parts = screen.split("╭─ job")
    return parts[:-1], [ANSI.sub("", p) for p in parts[1:]]


@pytest.mark.slow
def test_watch_at_a_terminal_redraws_one_panel_in_place_through_the_phases_to_the_outcome(client, host, migrated):
    # The launch waits until the watch has drawn its first panel: however slow the watch is to start, it sees the
    # job before training.
    release = host.sd_scripts / "launch.release"
    set_modes(host.sd_scripts, launcher_release_file=str(release), load_s=1.0, step_s=0.02)
    job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
    code, screen = in_a_terminal(lora_worker("jobs", "watch", str(job_id)), {**os.environ, **settings_env(migrated)},
                                 on_output=lambda read: b"\xe2\x95\xad\xe2\x94\x80 job" in read and release.touch())
    assert code == 0, screen[-2000:]
    before, frames = frames_of(screen)
    assert len(frames) >= 5, screen[-2000:]
    # In place: each frame after the first starts by moving the cursor up over the last one and erasing it.
    for lead_in in before[1:]:
        assert re.search(r"(\x1b\[2K\x1b\[1A){5,}\x1b\[2K$", lead_in), repr(lead_in[-200:])
    steps = [int(m[1]) for f in frames if (m := re.search(r"step (\d+)/400", f))]
    assert len(steps) == len(frames) and steps == sorted(steps) and len(set(steps)) >= 3 and steps[-1] == 400
    phases = [m[1] for f in frames if (m := re.search(r"status\s+running · (\w+)", f))]
    assert "training" in phases and phases.index("training") > 0  # an earlier phase was drawn first
    assert in_order(phases), phases
    assert any(re.search(r"eta\s+\d+:\d\d \(measured\)", f) for f in frames)
    assert any(re.search(r"curve\s+[▁▂▃▄▅▆▇█]{3,}\s+\d+ points, [\d.]+ → [\d.]+", f) for f in frames)
    assert re.search(r"status\s+succeeded", frames[-1])
    job = client.get(f"/train/{job_id}").get_json()
    lora = Path(job["lora_path"])
    outcome = ANSI.sub("", frames[-1]).split("╯", 1)[1]
    assert f"\r\njob {job_id} succeeded: {lora} ({lora.stat().st_size / 1e6:.1f} MB)\r\n" in outcome  # one line


@pytest.mark.slow
def test_watch_through_a_pipe_prints_one_plain_line_per_change_and_ends_with_the_failure(client, host, migrated):
    # The launch waits for the watch's first line (however slow its start), then each phase outlasts a poll.
    release = host.sd_scripts / "launch.release"
    set_modes(host.sd_scripts, launcher_release_file=str(release), load_s=1.5, step_s=0.01, oom_at_step=150)
    job_id = client.post("/train", json=host.payload()).get_json()["worker_job_id"]
    watch = subprocess.Popen(lora_worker("jobs", "watch"), env={**os.environ, **settings_env(migrated)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # no id: the active job
    first = watch.stdout.readline()
    release.touch()
    rest, stderr = watch.communicate(timeout=120)
    result = subprocess.CompletedProcess(watch.args, watch.returncode, first + rest, stderr)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "\x1b" not in result.stdout
    lines = result.stdout.splitlines()
    end = next(i for i, text in enumerate(lines) if text.startswith(f"job {job_id} failed"))
    progress, outcome, error_lines = lines[:end], lines[end], lines[end + 1:]
    line = re.compile(rf"^job {job_id}: (queued|running \((\w+)\)|failed), step (\d+)/400"
                      r"(, [\d.]+ steps/s)?, eta (-|\d+:\d\d \((measured|history)\))(, loss [\d.]+)?$")
    matches = [line.match(text) for text in progress]
    assert all(matches), [t for t, m in zip(progress, matches, strict=True) if not m]
    assert all(a != b for a, b in zip(progress, progress[1:], strict=False))  # a line only when something changed
    phases = [m[2] for m in matches if m and m[2]]
    assert in_order(phases) and len(set(phases)) >= 3, phases
    steps = [int(m[3]) for m in matches if m]
    assert steps == sorted(steps) and max(steps) >= 100
    assert outcome.startswith(f"job {job_id} failed (cuda_oom): ")
    assert "CUDA" in outcome
    # The rest of the error (the log's last lines) follows, indented, so the outcome line stays one line.
    assert error_lines and all(text.startswith("  ") for text in error_lines)
    assert any("OutOfMemoryError" in text for text in error_lines)


def test_watch_without_an_id_and_nothing_active_says_so_and_fails(migrated):
    out = io.StringIO()
    code = run(migrated, build_parser().parse_args(["jobs", "watch"]), out)
    assert code == 1
    assert out.getvalue().startswith("no active job")


def test_watch_of_a_finished_job_prints_its_outcome_at_once(db, migrated):
    job_id = finished(db, JobState.SUCCEEDED, 0.1, lora_path="/out/a.safetensors")
    out = io.StringIO()
    code = run(migrated, build_parser().parse_args(["jobs", "watch", str(job_id)]), out)
    assert code == 0
    assert out.getvalue().splitlines() == [f"job {job_id}: succeeded, step 3/400, eta -",
                                           f"job {job_id} succeeded: /out/a.safetensors (size unknown)"]


def test_show_draws_the_loss_curve_from_the_ledgers_points(db, migrated):
    job_id = finished(db, JobState.SUCCEEDED, 1)  # points (1, 0.5) and (2, 0.4)
    out = io.StringIO()
    assert run(migrated, build_parser().parse_args(["jobs", "show", str(job_id)]), out) == 0
    assert f"  loss curve:       {BLOCKS[-1]}{BLOCKS[0]}  2 points, 0.5000 → 0.4000\n" in out.getvalue()


def test_a_falling_curve_falls_from_the_highest_block_to_the_lowest():
    line = sparkline([1.0 - i / 100 for i in range(100)], width=20)
    assert len(line) == 20
    assert line[0] == BLOCKS[-1] and line[-1] == BLOCKS[0]
    assert [BLOCKS.index(c) for c in line] == sorted((BLOCKS.index(c) for c in line), reverse=True)


def test_a_sparkline_has_one_block_per_point_when_there_are_fewer_points_than_columns():
    assert sparkline([0.0, 1.0, 0.25], width=48) == BLOCKS[0] + BLOCKS[-1] + BLOCKS[2]  # 0.25 of 7 levels: 1.75


def test_a_flat_curve_is_a_flat_line_and_nan_losses_are_gaps():
    assert sparkline([0.5] * 10, width=5) == BLOCKS[0] * 5
    assert sparkline([1.0, float("nan"), None, 0.0], width=4) == BLOCKS[-1] + "  " + BLOCKS[0]
    assert describe_curve([]) == ""
    assert describe_curve([float("nan")]) == " " + "  1 points, no finite loss"  # one blank column


def test_the_log_lines_shown_skip_blank_lines_and_cannot_move_the_cursor(db, migrated):
    from lora_worker.ops.watch import LOG_LINES, _Looker
    from tests.helpers.cli import write_log

    job_id = finished(db, JobState.SUCCEEDED, 0.1)
    lines = [f"line {i}" for i in range(10)] + ["", "epoch 2/2", "", "evil \x1b[2J\x1b[H here", ""]
    write_log(migrated, job_id, lines).close()
    view = _Looker(db, migrated, job_id)()
    assert list(view.log_lines) == ["line 6", "line 7", "line 8", "line 9", "epoch 2/2", "evil ?[2J?[H here"]
    assert len(view.log_lines) == LOG_LINES

"""`lora-worker jobs watch [ID]`: one job, live, as an operator at a terminal wants to see it.

At a terminal: a panel that rich redraws in place (phase, step/total with a bar, rate, ETA and its basis,
loss, the loss curve as a sparkline from the ledger's points, the last log lines). Anywhere else (a pipe, a
file, journald): one plain line each time what it would say changes. Either way it ends when the job does,
with its outcome: the LoRA's path and size, or the failure class and error.

It reads the ledger and the run log directly, like every `jobs` command, reconciling the job at each look, so
a dead supervisor shows as `failed` here too.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from lora_worker.config import Settings
from lora_worker.ledger import repository as repo
from lora_worker.ledger.db import Database
from lora_worker.ledger.models import Job
from lora_worker.reconcile import current_job
from lora_worker.transcript.logreader import LogReader
from lora_worker.states import ACTIVE_STATES, JobState

POLL_S = 0.5
LOG_LINES = 6
SPARK_WIDTH = 48
BLOCKS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class View:
    """What one look at the job shows."""

    job: Job
    losses: Sequence[float | None]
    log_lines: Sequence[str]

    @property
    def ended(self) -> bool:
        return JobState(self.job.status) not in ACTIVE_STATES


def sparkline(values: Sequence[float | None], width: int = SPARK_WIDTH) -> str:
    """The curve in `width` block characters (each the mean of its share of the points), scaled min to max;
    a share with no finite value (NaN losses) is a blank."""
    if not values or width < 1:
        return ""
    buckets = _bucket_means(values, min(width, len(values)))
    finite = [b for b in buckets if b is not None]
    if not finite:
        return " " * len(buckets)
    low, high = min(finite), max(finite)
    span = high - low
    return "".join(" " if b is None else BLOCKS[round((b - low) / span * (len(BLOCKS) - 1)) if span else 0]
                   for b in buckets)


def _bucket_means(values: Sequence[float | None], count: int) -> list[float | None]:
    """The mean of the finite values in each of `count` equal shares of `values`; None for a share without."""
    n = len(values)
    buckets: list[float | None] = []
    for i in range(count):
        share = [v for v in values[i * n // count:(i + 1) * n // count] if v is not None and math.isfinite(v)]
        buckets.append(sum(share) / len(share) if share else None)
    return buckets


def describe_curve(losses: Sequence[float | None], width: int = SPARK_WIDTH) -> str:
    """`▇▆▅▃▂▁ 120 points, 1.0512 → 0.3310`, or '' without points."""
    finite = [v for v in losses if v is not None and math.isfinite(v)]
    if not losses:
        return ""
    ends = f", {finite[0]:.4f} → {finite[-1]:.4f}" if finite else ", no finite loss"
    return f"{sparkline(losses, width)}  {len(losses)} points{ends}"


def watch(db: Database, settings: Settings, job_id: int, out: TextIO, *, poll_s: float = POLL_S,
          terminal: bool | None = None) -> int:
    """Follow the job to its end; 0 when it succeeded, 1 otherwise. Ctrl-C stops watching (130), not the job."""
    look = _Looker(db, settings, job_id)
    is_tty = out.isatty() if terminal is None else terminal
    try:
        view = (_watch_live if is_tty else _watch_plain)(look, out, poll_s)
    except KeyboardInterrupt:
        out.write(f"stopped watching job {job_id}; it goes on (lora-worker jobs cancel {job_id} stops it)\n")
        return 130
    return 0 if view.job.status == JobState.SUCCEEDED.value else 1


class _Looker:
    """Reads the job at each look; the loss points and the log again only when the job's row has moved."""

    def __init__(self, db: Database, settings: Settings, job_id: int) -> None:
        self.db, self.settings, self.job_id = db, settings, job_id
        self.reader = LogReader(settings.log_dir, job_id)
        self._version: int | None = None
        self._log_size = -1
        self._losses: list[float | None] = []
        self._lines: list[str] = []

    def __call__(self) -> View:
        job = current_job(self.db, self.settings, self.job_id, actor="cli")
        if job.version != self._version:
            self._losses = [p.loss for p in repo.progress_points(self.db, job.id)]
            self._version = job.version
        try:
            size = self.reader.size() if self.reader.exists() else 0
            if size != self._log_size:
                # Blank lines (sd-scripts prints "\nepoch N/M\n") would take the room of the lines worth reading.
                text = self.reader.tail_lines(LOG_LINES * 4).text
                self._lines = [_printable(line) for line in text.splitlines() if line.strip()][-LOG_LINES:]
                self._log_size = size
        except OSError as exc:  # a link or a FIFO where the log was: said, never waited on
            self._lines, self._log_size = [f"(the run log cannot be read: {exc})"], -1
        return View(job, self._losses, self._lines)


def _watch_live(look: Callable[[], View], out: TextIO, poll_s: float) -> View:
    console = Console(file=out, force_terminal=True, highlight=False)
    view = look()
    # Redrawn only when we call refresh, so each frame is one look at the ledger.
    with Live(render(view), console=console, auto_refresh=False, redirect_stdout=False,
              redirect_stderr=False) as live:
        while not view.ended:
            time.sleep(poll_s)
            view = look()
            live.update(render(view), refresh=True)
    # A Text, so an error's brackets are not markup; soft-wrapped, so a long LoRA path stays one line to copy.
    console.print(Text(outcome_text(view.job)), soft_wrap=True)
    return view


def _watch_plain(look: Callable[[], View], out: TextIO, poll_s: float) -> View:
    view, said = look(), None
    while True:
        line = plain_line(view.job)
        if line != said:
            out.write(line + "\n")
            out.flush()
            said = line
        if view.ended:
            break
        time.sleep(poll_s)
        view = look()
    out.write(outcome_text(view.job) + "\n")
    out.flush()
    return view


def render(view: View) -> RenderableType:
    job = view.job
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("status", Text(job.status + (f" · {job.phase}" if job.phase and not view.ended else "")
                                + (" · cancel requested" if job.cancel_requested_at and not view.ended else "")))
    total = max(job.total_steps or 0, 1)
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=total, completed=min(job.step, total), width=40),
                Text(f"step {job.step}/{job.total_steps} ({100 * job.step // total}%)"))
    grid.add_row("progress", bar)
    grid.add_row("rate", Text(f"{job.rate:.2f} steps/s" if job.rate else "-"))
    grid.add_row("eta", Text(_eta(job)))
    grid.add_row("loss", Text(f"{job.loss:.4f}" if job.loss is not None else "-"))
    grid.add_row("curve", Text(describe_curve(view.losses) or "-"))
    log = Text("\n".join(view.log_lines) or "(no output yet)", style="dim", no_wrap=True, overflow="ellipsis")
    return Panel(Group(grid, Text(""), log), title=f"job {job.id} · {job.tier} on GPU {job.device_index}",
                 title_align="left")


def plain_line(job: Job) -> str:
    active = JobState(job.status) in ACTIVE_STATES  # a finished job's phase is only where it stopped
    parts = [job.status + (f" ({job.phase})" if job.phase and active else ""), f"step {job.step}/{job.total_steps}"]
    if job.rate:
        parts.append(f"{job.rate:.2f} steps/s")
    parts.append(f"eta {_eta(job)}")
    if job.loss is not None:
        parts.append(f"loss {job.loss:.4f}")
    return f"job {job.id}: " + ", ".join(parts)


def outcome_text(job: Job) -> str:
    if job.status == JobState.SUCCEEDED.value:
        size = f"{job.lora_size / 1e6:.1f} MB" if job.lora_size is not None else "size unknown"
        return f"job {job.id} succeeded: {job.lora_path} ({size})"
    if job.status == JobState.FAILED.value:
        head = f"job {job.id} failed ({job.failure_class})"
    else:
        head = f"job {job.id} {job.status}"
    error = (job.error or ("no error recorded" if job.status == JobState.FAILED.value else "")).splitlines()
    # The error's first line on the outcome's line; the rest (the log's last lines) indented under it.
    return head + (f": {error[0]}" if error else "") + "".join(f"\n  {line}" for line in error[1:])


def _eta(job: Job) -> str:
    if job.eta_s is None:
        return "-"
    seconds = max(0, round(job.eta_s))
    return f"{seconds // 60}:{seconds % 60:02d} ({job.eta_basis or 'unknown basis'})"


def _printable(line: str) -> str:
    # The log is the trainer's output: never let a stray control sequence move our cursor.
    return "".join(c if c.isprintable() or c == "\t" else "?" for c in line)

"""Benchmark 1, stream overhead: CPU the real supervisor spends on trainer output, against a bare pipe reader.

Both readers run the same emitter (bench/emitter.py: the real capture's phase lines, then the `steps` bar
redrawn as tqdm draws it) as their child, through the same kind of pipes, and are measured the same way:
on-CPU time of the reader process (/proc/<pid>/schedstat) from the emitter's first byte to the reader's exit,
read while the reader is a zombie so nothing after its last instruction is missed. The supervisor is the
real one (`python -m lora_worker.run`, started by `launch_supervisor` for a job whose argv is the
emitter); it decodes, parses, writes the run log and the ledger. The bare reader (bench/bare_reader.py) only
reads and discards.

- flood: the emitter pre-renders N bytes and writes them in 64 KiB writes, so the pipe stays full and both
  readers take it in the same 64 KiB chunks (the read() counts in the table show it).
- log-line flood: the same volume as `\n`-terminated log lines (the capture's own), not redraws: each is a
  line the supervisor must look at for a marker, write to the run log and keep for the error tail.
- parse path alone: the supervisor's output path (`TrainerOutput`: bytes, parser, run log, error tail) in
  this process, over the same two floods in 64 KiB chunks: CPU per chunk, without process start or end.
- realistic: redraws written one by one, paced (10 a second, and many more compressed in time). The CPU
  share is read over the middle of the run, from CPU samples every 20 ms, so the one-time costs of a job's
  start and end are reported apart (a 10-minute run pays them once).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import (BENCH_DIR, CAPTURE, Row, arg_parser, bench_host, cpu_seconds, emit, insert_job,
                          peak_rss_mib, python, read_syscalls, state, supervisor_pid, threads)
from lora_worker.ledger.db import Database
from lora_worker.host import processes
from lora_worker.run.local import launch_supervisor
from lora_worker.transcript.logfile import JobLog
from lora_worker.transcript.output import TrainerOutput
from bench import emitter
from tests.helpers import Host, wait_for

EMITTER = BENCH_DIR / "emitter.py"
BARE_READER = BENCH_DIR / "bare_reader.py"


@dataclass(frozen=True)
class Sample:
    """One reader over one emission, from the emitter's first byte to the reader's exit."""

    cpu_s: float
    wall_s: float
    reads: int
    peak_rss_mib: float
    threads: int
    trace: tuple[tuple[float, float], ...] = ()  # (seconds since the first byte, CPU seconds so far)

    def share(self, skip_start_s: float, skip_end_s: float) -> float:
        """CPU share in the steady part of the run: start-up and the end (outcome, last writes) left out."""
        window = [(t, c) for t, c in self.trace if skip_start_s <= t <= self.wall_s - skip_end_s]
        (t0, c0), (t1, c1) = window[0], window[-1]
        return (c1 - c0) / (t1 - t0)


def emitter_argv(go: Path, *args: str) -> list[str]:
    return [python(), str(EMITTER), "--capture", str(CAPTURE), "--go", str(go), *args]


def follow(pid: int, go: Path) -> Sample:
    """Measure `pid` while its emitter runs; the caller reaps it afterwards."""
    ready = Path(str(go) + ".ready")
    wait_for(ready.exists, timeout=300, interval=0.005, what="the emitter to render its output")
    cpu0, reads0, nthreads = cpu_seconds(pid), read_syscalls(pid), threads(pid)
    start = time.monotonic()
    go.touch()
    peak = 0.0
    trace = []
    while state(pid) not in ("Z", None):
        peak = max(peak, peak_rss_mib(pid))  # VmHWM is gone once it is a zombie: keep the last reading
        trace.append((time.monotonic() - start, cpu_seconds(pid) - cpu0))
        time.sleep(0.02)
    wall = time.monotonic() - start
    return Sample(cpu_seconds(pid) - cpu0, wall, read_syscalls(pid) - reads0, peak, nthreads, tuple(trace))


def supervised(host: Host, db: Database, go: Path, *args: str) -> Sample:
    job_id = insert_job(db, emitter_argv(go, *args), host.settings.train_root)
    launch_supervisor(job_id, host.settings)
    pid = supervisor_pid(db, job_id)  # re-parented to us (a subreaper), so it waits as a zombie for us
    sample = follow(pid, go)
    os.waitpid(pid, 0)
    return sample


def bare(go: Path, *args: str) -> Sample:
    proc = subprocess.Popen([python(), str(BARE_READER), *emitter_argv(go, *args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sample = follow(proc.pid, go)
    proc.wait()
    return sample


class Runs:
    """Numbered go-files, so every emission has its own."""

    def __init__(self, host: Host) -> None:
        self.host, self.n = host, 0
        self.db = Database.open(host.settings.database_path)

    def go(self) -> Path:
        self.n += 1
        return self.host.root / f"go-{self.n}"

    def supervised(self, *args: str) -> Sample:
        return supervised(self.host, self.db, self.go(), *args)

    def bare(self, *args: str) -> Sample:
        return bare(self.go(), *args)


def flood(runs: Runs, size: int, repeats: int, *, lines: bool = False) -> tuple[list[Row], list[str]]:
    args = ("--bytes", str(size), *(("--lines",) if lines else ()))
    pairs = []
    for _ in range(repeats):  # interleaved, so drift on a noisy machine hits both alike
        pairs.append((runs.bare(*args), runs.supervised(*args)))
    # The same job without the flood (the capture's phase lines and end only): what a job costs once, from
    # its first byte to its exit, whatever it writes.
    fixed = statistics.median(runs.supervised("--bytes", "0").cpu_s for _ in range(repeats))
    ratios = [s.cpu_s / b.cpu_s for b, s in pairs]
    sup = statistics.median(s.cpu_s for _, s in pairs)
    base = statistics.median(b.cpu_s for b, _ in pairs)
    ratio = statistics.median(ratios)
    mb = size / 1e6
    what, target = ("log lines", 30.0) if lines else ("output", 1.5)
    rows = [
        Row(f"CPU for {mb:g} MB of {what} (median of {repeats})", f"{sup:.3f} s", f"{base:.3f} s (bare reader)",
            ratio, f"≤ {target:g}×", ratio <= target),
        Row("… of which the job's own start and end (the same job with no flood: its phase lines, outcome, "
            "last writes, exit; median)", f"{fixed:.3f} s"),
        Row("… the rest, what the flood itself costs", f"{sup - fixed:.3f} s", f"{base:.3f} s (bare reader)",
            (sup - fixed) / base),
        Row("CPU per MB", f"{sup / mb * 1e3:.2f} ms", f"{base / mb * 1e3:.2f} ms"),
        Row("read() calls (median)", f"{statistics.median(s.reads for _, s in pairs):.0f}",
            f"{statistics.median(b.reads for b, _ in pairs):.0f}"),
        Row("wall time, first byte → reader exit (median)", f"{statistics.median(s.wall_s for _, s in pairs):.2f} s",
            f"{statistics.median(b.wall_s for b, _ in pairs):.2f} s"),
        Row("peak RSS of the reader (max)", f"{max(s.peak_rss_mib for _, s in pairs):.1f} MiB",
            f"{max(b.peak_rss_mib for b, _ in pairs):.1f} MiB"),
    ]
    notes = [f"ratios of the {repeats} pairs: " + ", ".join(f"{r:.2f}×" for r in ratios)
             + f" (min {min(ratios):.2f}×, max {max(ratios):.2f}×)",
             f"threads in the measured processes: supervisor {pairs[0][1].threads}, bare reader {pairs[0][0].threads}"]
    return rows, notes


def flood_chunks(size: int, *, lines: bool) -> list[bytes]:
    """What the emitter writes for a flood of `size` bytes, as the 64 KiB chunks a reader takes it in."""
    head, tail = emitter.load_capture(str(CAPTURE))
    middle = emitter.line_body(emitter.log_lines(head), size) if lines else emitter.body(3000, None, size, 150)
    data = b"".join(d for _, d in head + emitter.coalesce(middle, 1 << 16) + tail)
    return [data[i:i + (1 << 16)] for i in range(0, len(data), 1 << 16)]


def parse_path(size: int) -> tuple[list[Row], list[str]]:
    """CPU of the output path alone (TrainerOutput: bytes, parser, run log, error tail) per 64 KiB chunk, in
    this process: what the supervisor's own ratio is made of, less process start, the loop and the ledger."""
    rows = []
    for lines, what in ((False, "redraw flood"), (True, "log-line flood")):
        chunks = flood_chunks(size, lines=lines)
        times = []
        for _ in range(3):
            with tempfile.TemporaryDirectory(prefix="lora-bench-parse-") as tmp:
                output = TrainerOutput(JobLog(Path(tmp), 1, head_bytes=1 << 20, tail_bytes=1 << 20),
                                       lambda phase, step: None)
                start = time.thread_time()
                for i, chunk in enumerate(chunks):
                    output.consume(chunk, i * 0.001)
                    output.tick(i * 0.001)
                output.end()
                times.append(time.thread_time() - start)
                output.joblog.close()
        per_chunk = statistics.median(times) / len(chunks) * 1e6
        rows.append(Row(f"parse path alone, {what}: CPU per 64 KiB chunk (median of 3)", f"{per_chunk:.1f} µs",
                        f"{len(chunks)} chunks, {statistics.median(times) * 1e3:.0f} ms in all"))
    exits = sorted(interpreter_exit() for _ in range(5))
    rows.append(Row("an interpreter's exit after the supervisor's imports (what the supervisor skips: it leaves by "
                    "os._exit), median of 5",
                    f"{exits[2] * 1e3:.1f} ms", f"{exits[0] * 1e3:.1f}–{exits[-1] * 1e3:.1f} ms"))
    return rows, ["a process that imports what the supervisor imports, then exits normally; its CPU after its "
                  "last instruction (rusage at exit less the CPU it had used by then). The supervisor pays none of "
                  "it: once the run is recorded and its locks released it ends with os._exit (run/main.py leave)"]


def interpreter_exit() -> float:
    """CPU seconds a process spends exiting (module teardown, freeing) after importing what the supervisor runs."""
    code = ("import time, lora_worker.run.main, lora_worker.run.runner, lora_worker.host.process_host; "
            "print(time.process_time(), flush=True)")
    proc = subprocess.Popen([python(), "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    before = float(proc.stdout.read())
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return usage.ru_utime + usage.ru_stime - before


def realistic(runs: Runs, real_s: float, compressed_redraws: int, compressed_s: float) -> tuple[list[Row], list[str]]:
    """The CPU share in the steady part of a paced run (the target), and what a job costs once (start, end).

    The share is read over the run's middle (from 5 s in to 3 s before the end) from the reader's own CPU
    clock, sampled every 20 ms, so the one-time costs of starting and ending a job (a 10-minute run pays them
    once) do not pass for a per-second cost."""
    slow_n = max(2, int(10 * real_s))
    skip = (min(5.0, real_s / 4), min(3.0, real_s / 4))
    slow = runs.supervised("--redraws", str(slow_n), "--rate", "10")
    slow_bare = runs.bare("--redraws", str(slow_n), "--rate", "10")
    fast = runs.supervised("--redraws", str(compressed_redraws), "--rate", f"{compressed_redraws / compressed_s:g}")
    share, base = slow.share(*skip), slow_bare.share(*skip)
    once = slow.cpu_s - share * slow.wall_s
    rows = [
        Row(f"CPU share at 10 redraws/s, steady ({slow.wall_s:.0f} s run, middle window)",
            f"{share * 100:.3f} % of a core", f"{base * 100:.3f} % (bare reader)", share / base if base else None,
            "< 0.5 %", share < 0.005),
        Row("CPU share over the whole run, start and end included", f"{slow.cpu_s / slow.wall_s * 100:.3f} %",
            f"{slow_bare.cpu_s / slow_bare.wall_s * 100:.3f} %"),
        Row("one-time CPU of a job (start-up and end: outcome, last writes, exit)", f"{once * 1e3:.0f} ms"),
        Row("the same share over a 10-minute run", f"{(share + once / 600) * 100:.3f} %", "", None, "< 0.5 %",
            share + once / 600 < 0.005),
        Row(f"CPU share at {compressed_redraws / compressed_s:g} redraws/s, steady (compressed)",
            f"{fast.share(*skip) * 100:.3f} %"),
    ]
    notes = [f"runs: {slow_n} redraws in {slow.wall_s:.1f} s → {slow.cpu_s * 1e3:.1f} ms CPU in all; "
             f"{compressed_redraws} redraws in {fast.wall_s:.1f} s → {fast.cpu_s * 1e3:.1f} ms",
             f"peak RSS of the supervisor: {max(slow.peak_rss_mib, fast.peak_rss_mib):.1f} MiB"]
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--bytes", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real-s", type=float, default=30.0, help="seconds of the run at the real rate")
    parser.add_argument("--compressed-s", type=float, default=30.0, help="seconds for 6000 compressed redraws")
    args = parser.parse_args(argv)
    if args.quick:
        args.bytes, args.repeats, args.real_s, args.compressed_s = 200_000, 1, 0.3, 0.5
    processes.set_child_subreaper()  # supervisors re-parent to us: we read their CPU time as zombies
    with bench_host() as host:
        runs = Runs(host)
        try:
            rows, notes = flood(runs, args.bytes, args.repeats)
            emit("Stream overhead: flood of realistic output", rows, notes)
            rows, notes = flood(runs, args.bytes, args.repeats, lines=True)
            emit("Stream overhead: flood of log lines", rows, notes)
            rows, notes = parse_path(args.bytes)
            emit("Stream overhead: the parse path alone", rows, notes)
            rows, notes = realistic(runs, args.real_s, 6000 if not args.quick else 20, args.compressed_s)
            emit("Stream overhead: CPU share in a realistic run", rows, notes)
        finally:
            runs.db.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

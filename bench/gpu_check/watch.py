"""What the check watches while a job runs, five times a second: the card's memory in use (NVML, through the worker's
binding), the CPU time of the worker's processes and of the trainer's, and the run log's sample-pass lines.

The worker is gunicorn (master and worker) and the job's detached supervisor; the trainer is every process under the
supervisor (bwrap, accelerate, the training script). A process's CPU time is its last reading; the trainer's is
also taken from the supervisor's reaped children, whichever is larger (its last fifth of a second is otherwise lost).
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lora_worker.errors import NvmlUnavailable
from lora_worker.host.nvml import Nvml
from lora_worker.transcript.redraws import BAR, rate

EVERY_S = 0.2
# train_util.sample_images_common at 48d368fa: logged before each pass, then one image per prompt is saved.
SAMPLE_START = re.compile(r"generating sample images at step / \S+ \S+: (\d+)")
KEYS_MATCHED = "<All keys matched successfully>"


@dataclass
class Seen:
    vram: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), MiB in use on the card)
    sample_starts: dict[int, float] = field(default_factory=dict)  # step → when its start line was seen
    keys_matched: int = 0
    bar_rate: float | None = None  # steps per second on the trainer's last `steps` bar in the run log
    worker_cpu: dict[int, float] = field(default_factory=dict)  # pid → CPU seconds (last reading)
    supervisor_pid: int | None = None
    worker_cpu_at_start: dict[int, float] = field(default_factory=dict)
    trainer_cpu: dict[int, float] = field(default_factory=dict)
    reaped_cpu: float = 0.0  # the supervisor's children's CPU once it reaped them
    nvml_error: str | None = None

    def peak_mib(self, start: float | None = None, end: float | None = None) -> int | None:
        used = [mib for t, mib in self.vram if (start is None or t >= start) and (end is None or t <= end)]
        return max(used) if used else None

    @property
    def worker_cpu_s(self) -> float:
        return sum(v - self.worker_cpu_at_start.get(pid, 0.0) for pid, v in self.worker_cpu.items())

    @property
    def supervisor_cpu_s(self) -> float:
        return self.worker_cpu.get(self.supervisor_pid, 0.0) if self.supervisor_pid is not None else 0.0

    @property
    def trainer_cpu_s(self) -> float:
        return max(sum(self.trainer_cpu.values()), self.reaped_cpu)


class Watcher:
    """Started before the POST, stopped once the job has ended."""

    def __init__(self, web: list[psutil.Process], log: Path, nvml: Nvml | None, device: int) -> None:
        self.web, self.log, self.nvml, self.device = web, log, nvml, device
        self.seen = Seen()
        self.supervisor_pid: int | None = None  # set by the caller once the row names it
        self._offset, self._partial = 0, b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-check-watch", daemon=True)
        for proc in web:
            self.seen.worker_cpu_at_start[proc.pid] = _cpu(proc) or 0.0

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> Seen:
        self._stop.set()
        self._thread.join(10)
        self._tick()
        return self.seen

    def _loop(self) -> None:
        while not self._stop.wait(EVERY_S):
            self._tick()

    def _tick(self) -> None:
        now = time.time()
        self._vram(now)
        for proc in self.web:
            if (cpu := _cpu(proc)) is not None:
                self.seen.worker_cpu[proc.pid] = cpu
        self._supervisor()
        self._tail(now)

    def _vram(self, now: float) -> None:
        if self.nvml is None:
            return
        try:
            reading = next((r for r in self.nvml.read() if r.index == self.device), None)
        except NvmlUnavailable as exc:
            self.seen.nvml_error = exc.message
            return
        if reading is not None and reading.memory_used_mib is not None:
            self.seen.vram.append((now, reading.memory_used_mib))

    def _supervisor(self) -> None:
        if self.supervisor_pid is None:
            return
        try:
            sup = psutil.Process(self.supervisor_pid)
            self.seen.supervisor_pid = sup.pid
            with sup.oneshot():
                times = sup.cpu_times()
                self.seen.worker_cpu[sup.pid] = times.user + times.system
                self.seen.reaped_cpu = max(self.seen.reaped_cpu, times.children_user + times.children_system)
            for child in sup.children(recursive=True):
                if (cpu := _cpu(child)) is not None:
                    self.seen.trainer_cpu[child.pid] = cpu
        except psutil.Error:
            pass  # gone: its last reading stays

    def _tail(self, now: float) -> None:
        try:
            with self.log.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            if found := SAMPLE_START.search(line):
                self.seen.sample_starts.setdefault(int(found.group(1)), now)
            self.seen.keys_matched += line.count(KEYS_MATCHED)
            if "steps:" in line and (bar := BAR.search(line)) and (steps_per_s := rate(bar[5], bar[6])):
                self.seen.bar_rate = steps_per_s


def _cpu(proc: psutil.Process) -> float | None:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)

"""What the node writes for a job in `slurm_log_dir` (storage another party can write), read the one safe way:
no link followed, nothing that may block opened (host/fs.py `open_regular`).

`NodeLog` feeds the job's `--output` file to its TrainerOutput, a capped amount per cycle, and records how far
it got in `<log_dir>/job-<id>.node-offset` (the worker's own directory): a restarted poller parses the bytes
before that offset again (to know the phase, step and error tail) without logging them again, and appends
only what is new to the run log. `recorded_status` is the trainer's return code from `<id>.rc`.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.host.fs import open_regular
from lora_worker.slurm.sbatch import log_path, rc_path
from lora_worker.transcript.output import TrainerOutput

log = logging.getLogger(__name__)

READ_CAP = 8 << 20  # log bytes taken per job per cycle: a flood is read over a few cycles, not at once
CHUNK = 1 << 20
RC_MAX_BYTES = 64


def offset_path(settings: Settings, job_id: int) -> Path:
    return settings.log_dir / f"job-{job_id}.node-offset"


def saved_offset(settings: Settings, job_id: int) -> int:
    try:
        text = offset_path(settings, job_id).read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


class NodeLog:
    def __init__(self, settings: Settings, job_id: int, output: TrainerOutput) -> None:
        self.settings = settings
        self.job_id = job_id
        self.output = output
        self.fd: int | None = None
        self.pos = 0
        self.logged = saved_offset(settings, job_id)  # bytes before this are in the run log already

    def pump(self, now: float) -> None:
        if self.fd is None and not self._open():
            return
        assert self.fd is not None
        start, taken = self.pos, 0
        while taken < READ_CAP and (data := os.read(self.fd, min(CHUNK, READ_CAP - taken))):
            taken += len(data)
            self._feed(data, now)
        if self.pos > start and self.pos > self.logged:
            self._save()
        self.output.tick(now)

    def _open(self) -> bool:
        try:
            self.fd, _ = open_regular(None, str(log_path(self.settings, self.job_id)))
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:  # a link or a FIFO planted under its name: never followed, never read
            log.warning("job %s: cannot open its Slurm log (%s)", self.job_id, exc)
            return False

    def _feed(self, data: bytes, now: float) -> None:
        if self.pos < self.logged:  # its predecessor logged these: parsed again, not written again
            old = data[:self.logged - self.pos]
            joblog = self.output.joblog
            joblog.muted = True  # type: ignore[attr-defined]  # only a ResumedLog has a predecessor
            try:
                self.output.consume(old, now)
            finally:
                joblog.muted = False  # type: ignore[attr-defined]
            self.pos += len(old)
            data = data[len(old):]
        if data:
            self.output.consume(data, now)
            self.pos += len(data)

    def _save(self) -> None:
        path = offset_path(self.settings, self.job_id)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(f"{self.pos}\n")
            os.replace(tmp, path)
            self.logged = self.pos
        except OSError as exc:  # a full disk: a restart may log some bytes twice, never lose any
            log.warning("job %s: cannot record its log offset (%s)", self.job_id, exc)

    def discard(self) -> None:
        """The row has ended: no poller will take the job up again, so its offset record goes."""
        offset_path(self.settings, self.job_id).unlink(missing_ok=True)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def recorded_status(self) -> int | None:
        """The trainer's return code as the batch script recorded it, None if it did not (or not yet)."""
        try:
            fd, _ = open_regular(None, str(rc_path(self.settings, self.job_id)))  # no link, no FIFO: never waited on
        except OSError:
            return None
        try:
            text = os.read(fd, RC_MAX_BYTES).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        try:
            return int(text)
        except ValueError:
            return None

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
import re
from pathlib import Path

from lora_worker.config import Settings
from lora_worker.host.fs import open_regular, read_capped
from lora_worker.slurm.sbatch import log_path, rc_path
from lora_worker.transcript.output import TrainerOutput

log = logging.getLogger(__name__)

READ_CAP = 8 << 20  # log bytes taken per job per cycle: a flood is read over a few cycles, not at once
CHUNK = 1 << 20
RC_MAX_BYTES = 64
OFFSET_MAX_BYTES = 32
OFFSET = re.compile(rb"([0-9]{1,18})\n?")  # what `_save` writes: the offset and a newline
RETURN_CODE = re.compile(rb"\s*(-?[0-9]{1,3})\s*")  # a Popen return code, as run/node.py writes it
MAX_SIGNAL, MAX_STATUS = 127, 255


def offset_path(settings: Settings, job_id: int) -> Path:
    return settings.log_dir / f"job-{job_id}.node-offset"


def saved_offset(settings: Settings, job_id: int) -> int:
    """How far the run log has the node's log, as `_save` recorded it; 0 (everything is logged again) when there is
    no record or it is not one `_save` writes: a restart may log some bytes twice, never lose any."""
    return _number(_read_small(offset_path(settings, job_id), OFFSET_MAX_BYTES), OFFSET) or 0


def _read_small(path: Path, cap: int) -> bytes | None:
    """A small file of ours or the node's, read the one safe way (no link, no FIFO); None if it cannot be, or holds
    more than `cap` bytes."""
    try:
        fd, _ = open_regular(None, str(path))
    except OSError:
        return None
    try:
        return read_capped(fd, cap)
    except OSError:
        return None
    finally:
        os.close(fd)


def _number(data: bytes | None, form: re.Pattern[bytes]) -> int | None:
    """The integer `data` holds in `form` (ASCII, nothing else around it but its newline), or None."""
    found = form.fullmatch(data) if data is not None else None
    return int(found[1]) if found is not None else None


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
            self.fd, st = open_regular(None, str(log_path(self.settings, self.job_id)))
            if self.logged > st.st_size:  # the node only appends: a record past its end is not one we wrote
                log.warning("job %s: its log offset record %s is past the log's end (%s bytes); the log is "
                            "logged again from its start", self.job_id, self.logged, st.st_size)
                self.logged = 0
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
        """The trainer's return code as the node recorded it (run/node.py: a Popen return code, negative when a
        signal killed it), None if it did not (or not yet), or if the file holds anything else: the node's storage
        is another party's too, and a number no trainer returns is not its status."""
        status = _number(_read_small(rc_path(self.settings, self.job_id), RC_MAX_BYTES), RETURN_CODE)
        return status if status is not None and -MAX_SIGNAL <= status <= MAX_STATUS else None

"""Taking the trainer's output off its pipe, one read per pass of the loop, into `TrainerOutput`."""
from __future__ import annotations

from lora_worker.transcript.output import TrainerOutput
from lora_worker.run.seam import RunHost, Trainer

SELECT_TIMEOUT_S = 0.2
BUSY_BYTES = 8 * 1024  # more than this per wake-up means a flood (a quarter second of redraws is ~250 bytes)


class OutputReader:
    def __init__(self, host: RunHost, output: TrainerOutput) -> None:
        self.host = host
        self.output = output
        self.open = True  # the pipe has not reached end of file: some process of the job still holds it

    def pump(self, trainer: Trainer) -> bool:
        """Read what the pipe holds; whether the trainer is writing a lot (then the loop does not pause)."""
        data = trainer.read(SELECT_TIMEOUT_S)
        if data is None:
            self.open = False
            return False
        if data:
            self.output.consume(data, self.host.monotonic())
        return len(data) >= BUSY_BYTES

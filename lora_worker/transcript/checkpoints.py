"""The step checkpoints of a run, for every backend: each save the parser kept (`Progress.saves`) becomes a row of
the ledger's `checkpoints` (ledger/checkpoints.py), written with the progress (transcript/progress.py).

- A step LoRA is `<output_dir>/<output_name>-step%08d.safetensors`, announced by `saving checkpoint: <path>`
  (train_network.py save_model). It is written in place, so it is complete only once the trainer has moved on:
  at the next `steps` redraw (set_postfix follows the save, the state's save and the pruning), or when the
  output ended. Then it is verified as the final LoRA is (host/safetensors.py `verify_lora`: the file opened
  without following links in the recorded output directory, header, rank, dtype, name, seed, max steps), and
  its `ss_steps` must be the step in its name. A LoRA that fails is recorded `verified` false with the reason;
  the job goes on: a step LoRA is never the job's result (only `<output_name>.safetensors` is, outcome.py).
- A state is `saving state at step N` (`<output_name>-step%08d-state/`) or `saving last state.`
  (`<output_name>-state/`, the bar's step then); recorded as seen, not checked here: its check is the resume's.
- `removing old checkpoint: <path>` and `removing old state: <path>`: the trainer pruned it. The row is marked
  removed, not failed; a LoRA removed before it was verified is never verified.
Only paths of the job's own output directory and name count: the trainer's text is data.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lora_worker.ledger.checkpoints import LORA, STATE, CheckpointRow
from lora_worker.ledger.statements import utcnow
from lora_worker.transcript.outcome import RecordedLora, recorded_lora
from lora_worker.transcript.parser import Progress, Save

if TYPE_CHECKING:
    from lora_worker.host.safetensors import ArtifactCheck, ExpectedLora

STEP_NUMBER = re.compile(r"[0-9]{8,10}")  # `%08d` of a step a ledger column holds (ASCII: `\d` is any script's)


class CheckpointJob(RecordedLora, Protocol):
    @property
    def output_dir(self) -> str: ...


@dataclass
class _Pending:
    """A step LoRA seen, not yet verified: it is complete once a redraw follows its save line."""

    row: CheckpointRow
    redraws: int


@dataclass
class Checkpoints:
    job: CheckpointJob
    _taken: int = 0  # how many of the parser's saves were looked at
    _rows: dict[tuple[str, str], CheckpointRow] = field(default_factory=dict)
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def take(self, progress: Progress, *, ended: bool) -> list[CheckpointRow]:
        """The rows that changed since the last call: new saves, removals, and the step LoRAs now complete
        (verified here, once each)."""
        changed: dict[tuple[str, str], CheckpointRow] = {}
        now = utcnow()
        for save in progress.saves[self._taken:]:
            row = self._row_of(save, now)
            if row is not None:
                changed[(row.kind, row.path)] = self._keep(row)
        self._taken = len(progress.saves)
        for path, pending in list(self._pending.items()):
            if ended or progress.redraws > pending.redraws:
                del self._pending[path]
                row = self._rows[(LORA, path)]
                if row.removed_at is None:
                    changed[(LORA, path)] = self._keep(self._verified(row))
        return list(changed.values())

    def lora_at(self, step: int) -> CheckpointRow | None:
        """The step LoRA of `step` as known now (a sample pass names it), or None."""
        return next((row for (kind, _), row in self._rows.items() if kind == LORA and row.step == step), None)

    def _keep(self, row: CheckpointRow) -> CheckpointRow:
        self._rows[(row.kind, row.path)] = row
        return row

    def _row_of(self, save: Save, now: datetime) -> CheckpointRow | None:
        name = self.job.output_name
        if save.kind == "saving":
            step = self._step_in(save.text, ".safetensors")
            if step is None:
                return None  # the final LoRA, or an epoch's: not a step checkpoint
            self._pending[save.text] = _Pending(CheckpointRow(LORA, step, save.text, now), save.redraws)
            return self._rows.get((LORA, save.text)) or CheckpointRow(LORA, step, save.text, now)
        if save.kind == "state_saved":
            step = int(save.text)
            return CheckpointRow(STATE, step, os.path.join(self.job.output_dir, f"{name}-step{step:08d}-state"), now)
        if save.kind == "last_state":
            return CheckpointRow(STATE, int(save.text or 0), os.path.join(self.job.output_dir, f"{name}-state"), now)
        kind, suffix = (LORA, ".safetensors") if save.kind == "removed_checkpoint" else (STATE, "-state")
        step = self._step_in(save.text, suffix)
        if step is None:
            return None
        known = self._rows.get((kind, save.text)) or CheckpointRow(kind, step, save.text, now)
        return replace(known, removed_at=known.removed_at or now)

    def _step_in(self, path: str, suffix: str) -> int | None:
        """The step of `<output_dir>/<output_name>-step%08d<suffix>`, or None for any other path."""
        prefix = os.path.join(self.job.output_dir, f"{self.job.output_name}-step")
        if not (path.startswith(prefix) and path.endswith(suffix)):
            return None
        digits = path[len(prefix):len(path) - len(suffix)]
        return int(digits) if STEP_NUMBER.fullmatch(digits) else None

    def _verified(self, row: CheckpointRow) -> CheckpointRow:
        problem, check = verify_step_lora(Path(row.path), recorded_lora(self.job), row.step)
        return replace(row, bytes=check.size, sha256=check.sha256 if problem is None else None,
                       verified=problem is None, error=problem)


def verify_step_lora(path: Path, expected: ExpectedLora, step: int) -> tuple[str | None, ArtifactCheck]:
    """(why the step LoRA is not the one its save announced, or None; the artifact check)."""
    from lora_worker.host.safetensors import verify_lora  # loaded once the trainer runs (runner.py END_MODULES)

    check = verify_lora(path, replace(expected, trained_steps=None))  # its steps are the save's, checked below
    if check.problem is not None:
        return check.problem, check
    if (steps := check.metadata.get("ss_steps")) != str(step):
        return f"ss_steps {steps!r} instead of {step}", check
    return None, check

"""The check's one table: rows of what was measured, each with how, or, where nothing was, why.

A row with no value must say why (`Row.why`): the check never prints a guess. The same rows are written as JSON.
Pure: no I/O, so the table's rules are unit-tested (tests/bench/test_gpu_check.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

Value = float | int | str | None


@dataclass(frozen=True)
class Row:
    section: str  # what part of the check: `card`, `nvml`, `deep health`, `run 1024 px`, …
    measure: str  # what the value is
    value: Value
    unit: str = ""
    how: str = ""  # where the figure comes from (NVML, the ledger, the trainer's bar, the bench's own clock)
    why: str | None = None  # set exactly when value is None: why nothing was measured
    ok: bool | None = None  # for a check (agree / passed); None where the row only reports

    def __post_init__(self) -> None:
        if self.value is None and not self.why:
            raise ValueError(f"{self.section}: {self.measure}: a row without a value must say why")
        if self.value is not None and self.why:
            raise ValueError(f"{self.section}: {self.measure}: a measured row has no `why`")

    @property
    def text(self) -> str:
        if self.value is None:
            return f"not measured: {self.why}"
        mark = "" if self.ok is None else ("" if self.ok else "**FAIL** ")
        return mark + number(self.value) + (f" {self.unit}" if self.unit else "")


def unmeasured(section: str, measure: str, why: str, how: str = "") -> Row:
    return Row(section, measure, None, how=how, why=why)


def number(value: Value) -> str:
    """A figure as printed: three decimals under 10, one under 1000, none above; text as it is."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return str(value)
    size = abs(value)
    return f"{value:.3f}" if size < 10 else f"{value:.1f}" if size < 1000 else f"{value:.0f}"


def render(title: str, rows: Iterable[Row]) -> str:
    """One markdown table; a section's name is printed on its first row only."""
    lines = [f"### {title}", "", "| section | measure | value | how |", "|---|---|---|---|"]
    last = None
    for row in rows:
        section = row.section if row.section != last else ""
        last = row.section
        lines.append("| " + " | ".join(_cell(c) for c in (section, row.measure, row.text, row.how)) + " |")
    return "\n".join(lines) + "\n"


def as_json(meta: Mapping[str, Any], rows: Iterable[Row]) -> dict[str, Any]:
    """The document written beside the table: `meta` (card, date, machine, arguments) and every row."""
    return {**meta, "rows": [{**asdict(r), "text": r.text} for r in rows]}


def failed(rows: Iterable[Row]) -> list[Row]:
    return [r for r in rows if r.ok is False]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")

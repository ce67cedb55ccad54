"""One check of whether jobs can run, as `doctor` prints it and `GET /healthz?deep=1` lists it. Pure data: every
layer that checks something (dispatch's readiness of this host, a backend's of where it places jobs, the
operator's doctor) makes these, so it imports nothing of the project.

A check passed (`ok`), failed (a required one fails the deep health gate and `doctor`; an optional one is a
warning), or could not be made (`checked` False: said as `skip` with why, never as passed; `doctor --strict`
fails on it, the deep health gate lists it under `unchecked`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True  # a failed optional check is a warning, not a failure
    simulated: bool = False  # passed only as the simulated host plays it (no GPU, no torch): said so
    checked: bool = True  # False: it could not be made (`unchecked`); neither passed nor failed

    @classmethod
    def unchecked(cls, name: str, why: str) -> Check:
        """What could not be checked, and why: `detail` starts "not checked: "."""
        return cls(name, False, f"not checked: {why}", required=False, checked=False)

    def line(self) -> str:
        mark = ("skip" if not self.checked else "sim" if self.simulated and self.ok else "ok" if self.ok
                else "FAIL" if self.required else "warn")
        return f"[{mark:>4}] {self.name}: {self.detail}"

    @property
    def failed(self) -> bool:
        return self.required and not self.ok

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "required": self.required, "simulated": self.simulated,
                "checked": self.checked, "detail": self.detail}


def tally(checks: Iterable[Check]) -> str:
    """`doctor`'s closing line: how many passed, failed, could not be made, or passed only as simulated."""
    made = list(checks)
    kinds = {"failed": [c for c in made if c.failed], "not checked": [c for c in made if not c.checked],
             "only as the simulated host plays them (no GPU, no torch)": [c for c in made if c.simulated]}
    passed = len(made) - len(kinds["failed"]) - len(kinds["not checked"])
    return "; ".join([f"{passed}/{len(made)} checks passed", *(f"{len(v)} {k}" for k, v in kinds.items() if v)])

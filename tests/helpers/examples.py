"""How many examples a Hypothesis test draws: all of them in `make test`, a tenth (at least 20) in `make test-fast`,
the edit-test loop, which is meant to take under a minute; the full suite and CI still draw every one."""
from __future__ import annotations

import os

FAST = os.environ.get("LW_TEST_FAST") == "1"


def examples(full: int) -> int:
    return max(full // 10, 20) if FAST else full

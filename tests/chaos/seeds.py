"""The random loops' length and seed (tests/chaos/test_kill_points.py, test_webhook_kill_points.py).

CHAOS_ITERATIONS sets the length: each module has its own default for `make test` (docs/testing.md says which
and why), `make chaos` sets 200. Each run draws a new seed unless CHAOS_SEED is set, so every CI run kills at
other moments; the seed is printed at the start of the test (its captured output is shown with a failure) and
every failure message names it with the iteration, which is all a replay needs: the loop draws the same
sequence for the same seed, whatever its length.
"""
from __future__ import annotations

import os
import secrets


def iterations(default: int) -> int:
    return int(os.environ.get("CHAOS_ITERATIONS", default))


def draw() -> int:
    """CHAOS_SEED, else a new seed."""
    given = os.environ.get("CHAOS_SEED")
    return int(given) if given else secrets.randbelow(10**9)


def replay(seed: int, iteration: int) -> str:
    """The command that runs the loop again up to `iteration` with the same draws."""
    return f"CHAOS_SEED={seed} CHAOS_ITERATIONS={iteration + 1}"

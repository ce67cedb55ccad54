"""The example budget of the property tests marked `fuzz` (a parser of bytes from the train root, a node or a
receiver, fed what Hypothesis draws): the Hypothesis profile HYPOTHESIS_PROFILE names, `bounded` unless told.
`make test` and `make test-fast` draw PROPERTY_EXAMPLES of each (all of them together add seconds), `make fuzz`
FUZZ_EXAMPLES with no deadline. A property test sets no max_examples of its own, so one variable moves all of them:
tests/conftest.py refuses to collect one that does. Both profiles start from the one Hypothesis chose (its `ci`
profile under CI: derandomized, so CI draws the same examples every run). The tests with budgets of their own
(tests/chaos, CHAOS_MODEL_EXAMPLES; tests/dispatch/test_argv.py, tests/helpers/examples.py) keep them."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

from hypothesis import HealthCheck, settings

PROPERTY_EXAMPLES = 60
FUZZ_EXAMPLES = 5000
PROFILE_VARIABLE = "HYPOTHESIS_PROFILE"
MARKER = "fuzz"


def load_profile(environ: Mapping[str, str] = os.environ) -> str:
    """Register `bounded` and `fuzz` and load the one the environment names; its name."""
    chosen = settings.get_profile("ci" if settings.default.derandomize else "default")
    settings.register_profile("bounded", chosen, max_examples=PROPERTY_EXAMPLES, deadline=None)
    settings.register_profile("fuzz", chosen, max_examples=FUZZ_EXAMPLES, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    name = environ.get(PROFILE_VARIABLE, "bounded")
    settings.load_profile(name)
    return name


def own_budget(test: Callable[..., object]) -> int | None:
    """The max_examples a Hypothesis test sets itself, or None when it draws the loaded profile's (or is not one)."""
    if not getattr(test, "is_hypothesis_test", False):
        return None
    budget = test._hypothesis_internal_use_settings.max_examples  # type: ignore[attr-defined]
    return None if budget == settings.default.max_examples else budget


def budget_offences(tests: Iterable[tuple[str, Callable[..., object]]]) -> list[str]:
    """Of (name, function) pairs of tests marked fuzz, those that set a budget of their own."""
    return [f"{name} sets max_examples={budget}: a test marked {MARKER} draws the profile's "
            f"({PROFILE_VARIABLE}, tests/helpers/fuzz.py)" for name, test in tests if (budget := own_budget(test))]

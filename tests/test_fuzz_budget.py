"""Every property test marked `fuzz` draws the budget of the Hypothesis profile HYPOTHESIS_PROFILE names
(tests/helpers/fuzz.py), none of its own: that is how `make fuzz` runs all of them at length with one variable."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tests.helpers import fuzz


def test_the_profiles_are_loaded_and_the_fuzz_one_is_the_longer():
    assert settings.get_profile("bounded").max_examples == fuzz.PROPERTY_EXAMPLES
    assert settings.get_profile("fuzz").max_examples == fuzz.FUZZ_EXAMPLES > fuzz.PROPERTY_EXAMPLES
    assert settings.get_profile("fuzz").deadline is None and settings.get_profile("bounded").deadline is None
    assert settings.default.max_examples == fuzz.PROPERTY_EXAMPLES  # make test names no profile: bounded


def test_the_environment_names_the_profile():
    try:
        assert fuzz.load_profile({fuzz.PROFILE_VARIABLE: "fuzz"}) == "fuzz"
        assert settings.default.max_examples == fuzz.FUZZ_EXAMPLES
    finally:
        assert fuzz.load_profile({}) == "bounded"
    assert settings.default.max_examples == fuzz.PROPERTY_EXAMPLES


def test_a_property_test_with_a_budget_of_its_own_is_an_offence():
    @given(st.integers())
    def follows(x: int) -> None: ...

    @settings(max_examples=7)
    @given(st.integers())
    def own(x: int) -> None: ...

    @settings(deadline=None)
    @given(st.integers())
    def other_setting(x: int) -> None: ...

    offences = fuzz.budget_offences([("follows", follows), ("own", own), ("other_setting", other_setting),
                                     ("plain", lambda: None)])
    assert len(offences) == 1 and offences[0].startswith("own sets max_examples=7")


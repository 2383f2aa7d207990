"""How the long fuzz runs judge the router's RSS (``bench.fuzz.sides.rss_growth``)."""

from __future__ import annotations

import pytest

from bench.fuzz.sides import RSS_GROWTH_LIMIT, rss_growth

MIB = 1024
# The Redis side's 100,000-case run, in MiB every 5,000 cases: two allocator levels, no
# trend. Its last sample against its first read +24%.
TWO_LEVELS = [88, 106, 91, 93, 92, 108, 109, 109, 92, 110, 109, 94, 110, 93, 93, 109, 110]


def test_an_allocator_moving_between_two_levels_is_not_growth() -> None:
    assert rss_growth([m * MIB for m in TWO_LEVELS]) < RSS_GROWTH_LIMIT


def test_memory_that_grows_with_the_cases_is() -> None:
    leaking = [(240 + 5 * i) * MIB for i in range(20)]  # +5 MiB every sample
    assert rss_growth(leaking) > RSS_GROWTH_LIMIT


def test_two_samples_are_the_last_against_the_first() -> None:
    assert rss_growth([100, 120]) == pytest.approx(0.2)

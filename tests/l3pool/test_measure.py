"""One definition of a percentile and a spread (l3pool.measure)."""

from __future__ import annotations

import math

import pytest

from l3pool.measure import percentile, spread


def test_percentile_is_a_measured_value_nearest_rank() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert [percentile(xs, q) for q in (0, 25, 50, 75, 100)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile([1.0, 2.0], 50) in (1.0, 2.0)  # never the interpolated 1.5
    assert math.isnan(percentile([], 99))
    with pytest.raises(ValueError, match="q must be in"):
        percentile(xs, 101)


def test_spread() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([0.123456789], digits=3) == {"median": 0.123, "min": 0.123, "max": 0.123}
    with pytest.raises(ValueError):
        spread([])

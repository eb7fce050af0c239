"""The summary statistics every report of the project uses (torch-free): one definition of a
percentile and of a spread, so figures from the benchmarks, `l3pool prefetch-check` and
`l3pool chaos` compare like with like."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (q in [0, 100]) of `xs`: a value that was measured, never
    an interpolation between two; nan when `xs` is empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not xs:
        return math.nan
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))])


def spread(xs: Sequence[float], digits: int = 6) -> dict[str, float]:
    """Median, min and max of repeated runs (what a report prints beside a headline)."""
    if not xs:
        raise ValueError("spread of no runs")
    return {
        "median": round(statistics.median(xs), digits),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
    }

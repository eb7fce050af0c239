"""bench.prefetch._locks.lock_stats with known samples: percentiles, and ratios that compare one statistic
on both sides (paired per request), so an outlier in the raw floor cannot flatter the protocol."""

from __future__ import annotations

import pytest

from bench.prefetch._locks import lock_stats
from l3pool.measure import percentile

MS = 1e-3


def test_pct_nearest_rank() -> None:
    xs = [float(x) for x in range(1, 101)]  # 1..100
    assert (
        percentile(xs, 50) == 51 and percentile(xs, 99) == 99 and percentile(xs, 0) == 1 and percentile(xs, 100) == 100
    )
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) != percentile([], 50)  # nan


def test_lock_stats_known_inputs() -> None:
    n = 4
    acq = [3 * MS, 3 * MS, 6 * MS, 3 * MS]
    ex, txn = [1 * MS] * n, [1 * MS, 1 * MS, 2 * MS, 1 * MS]  # request 2 slow on both sides
    joins = [[1 * MS, 3 * MS], [2 * MS, 2 * MS], [4 * MS, 4 * MS], [2 * MS, 2 * MS]]
    get = [1 * MS, 1 * MS, 2 * MS, 1 * MS]
    out = lock_stats(acq, ex, txn, joins, get, release=[MS] * n)
    assert out["lock_acquire_p50_ms"] == pytest.approx(3.0) and out["lock_acquire_p99_ms"] == pytest.approx(6.0)
    assert out["raw_acquire_floor_p50_ms"] == pytest.approx(2.0) and out["raw_acquire_floor_p99_ms"] == 3.0
    # paired: 3/2, 3/2, 6/3, 3/2 -> median 1.5; p99 vs p99 of the per-request sums: 6/3
    assert out["lock_acquire_vs_raw"] == pytest.approx(1.5)
    assert out["lock_acquire_p99_vs_raw"] == pytest.approx(2.0)
    # joins: per-request mean / raw get -> 2, 2, 2, 2
    assert out["stage_join_vs_raw"] == pytest.approx(2.0)
    assert out["stage_join_p99_ms"] == pytest.approx(4.0) and out["stage_join_p99_vs_raw"] == pytest.approx(2.0)
    assert out["release_p99_ms"] == pytest.approx(1.0) and "lock_lookup_p50_ms" not in out


def test_outlier_in_the_floor_does_not_flatter_the_protocol() -> None:
    """The old p99(acq) / (p99(exists) + p99(txn)) read ~1.5 when the two raw calls had their
    outliers in different requests; every request was in fact 3x its own floor."""
    n = 100
    ex = [1 * MS] * n
    txn = [1 * MS] * n
    ex[10] = ex[11] = txn[20] = txn[21] = 100 * MS  # outliers in different requests
    floor = [e + t for e, t in zip(ex, txn, strict=True)]
    acq = [3 * f for f in floor]  # always 3x its own floor
    out = lock_stats(acq, ex, txn, [[MS]] * n, [MS] * n)
    old = percentile(acq, 99) / (percentile(ex, 99) + percentile(txn, 99))
    assert old == pytest.approx(303 / 200)  # what the old formula claimed: about 1.5
    assert out["lock_acquire_vs_raw"] == pytest.approx(3.0)
    assert out["lock_acquire_p99_vs_raw"] == pytest.approx(3.0)


def test_lock_stats_bad_input() -> None:
    with pytest.raises(ValueError, match="one sample per request"):
        lock_stats([], [], [], [], [])
    with pytest.raises(ValueError, match="one sample per request"):
        lock_stats([MS, MS], [MS], [MS, MS], [[MS], [MS]], [MS, MS])

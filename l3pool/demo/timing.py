"""Honest statistics of the demo's repeated, interleaved timings.

Every timing is measured in `repeats` rounds; within a round the configurations run request by
request in a rotating order, so drift (clocks, warm-up, other load) hits all of them alike. A
statistic is the median over rounds with its spread (the range the rounds allow), never a single
run. The self-check: requests that no configuration hit (the miss path) must take the same time
in every configuration within the measured spread; otherwise the report is `biased`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

FABRICS_GBPS = (25.0, 50.0, 100.0)  # what-if: RDMA per node


def med_spread(xs: Sequence[float], nd: int = 3) -> dict[str, Any]:
    """Median of repeated values with their range and half-range (`spread`)."""
    if not xs:
        raise ValueError("med_spread needs at least one value")
    lo, hi = min(xs), max(xs)
    return {"median": round(statistics.median(xs), nd), "min": round(lo, nd), "max": round(hi, nd),
            "spread": round((hi - lo) / 2, nd), "runs": len(xs)}  # fmt: skip


def ttft_stats(per_rep: Sequence[Sequence[float]]) -> dict[str, Any]:
    """TTFT of one configuration: per_rep[r][i] is request i's time (ms) in round r. Each request's
    median over rounds, then the median and p90 over requests; `spread`: half the range of the
    rounds' own medians (how much the whole-trace median moved between rounds)."""
    arr = np.asarray(per_rep, dtype=float)  # [rounds, requests]
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError("ttft_stats needs rounds x requests times")
    per_req = np.median(arr, axis=0)
    rounds = np.median(arr, axis=1)
    return {
        "median": round(float(np.median(per_req)), 3),
        "p90": round(float(np.percentile(per_req, 90)), 3),
        "mean": round(float(per_req.mean()), 3),
        "spread": round(float(rounds.max() - rounds.min()) / 2, 3),
        "total_ms": med_spread([float(x) for x in arr.sum(axis=1)]),
        "rounds": int(arr.shape[0]),
    }


def miss_check(nc: Sequence[float], ca: Sequence[float]) -> dict[str, Any]:
    """Miss-path comparison of one cached configuration with no cache: nc[r], ca[r] are the summed
    times (s) of the never-hit requests in round r (paired: same round, interleaved). Overhead
    1 - t_nc / t_ca per round: median and range. `equal` when the range includes 0 or the median
    difference lies within the rounds' own spread of the no-cache times."""
    if len(nc) != len(ca) or not nc:
        raise ValueError("miss_check needs the same number (>= 1) of rounds on both sides")
    ov = [1.0 - a / b for a, b in zip(nc, ca, strict=True)]
    diff = [b - a for a, b in zip(nc, ca, strict=True)]
    noise = (max(nc) - min(nc)) / 2
    md = statistics.median(diff)
    equal = min(ov) <= 0 <= max(ov) or abs(md) <= noise
    return {
        "overhead": round(statistics.median(ov), 4),
        "spread": [round(min(ov), 4), round(max(ov), 4)],
        "diff_s": round(md, 4),
        "noise_s": round(noise, 4),
        "equal_within_spread": bool(equal),
        "headline": _overhead_headline(ov),
    }


def _overhead_headline(ov: Sequence[float]) -> str:
    """Never a bare negative: a cache cannot make uncached tokens faster, so a cache run faster in
    every round is noise or bias (the `biased` self-check says which), not a result."""
    if min(ov) <= 0 <= max(ov):
        return "within noise"
    if max(ov) < 0:
        return "none measured (the cache run was faster in every round: noise or bias, see `biased`)"
    return f"{statistics.median(ov):+.1%}"


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, Any]:
    """T(n) = a + b n by least squares; a negative intercept is not a result: then the line through
    0 (`a_ms` 0, `intercept_clamped` true)."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("a fit needs >= 2 distinct lengths")
    b, a = np.polyfit(x, y, 1)
    clamped = bool(a < 0)
    if clamped:
        a, b = 0.0, float((x * y).sum() / (x * x).sum())
    return {"a_ms": round(float(a), 3), "b_us_per_token": round(float(b) * 1e3, 4), "intercept_clamped": clamped}


def what_if(rows: Sequence[dict[str, float]], nc_ms: Sequence[float]) -> dict[str, Any]:
    """Replays the L1+L2+L3 requests' measured L3 bytes against other L3 fabrics. Each row: the
    request's measured TTFT `ttft_ms`, its L3 bytes `l3_bytes` and the time the engine waited for
    them `l3_wait_ms`. Per fabric: TTFT = measured - measured L3 wait + bytes / bandwidth (the L3
    fetch taken as not overlapped: conservative). nc_ms: the same requests' no-cache times."""
    nc = float(np.median(nc_ms)) if len(nc_ms) else 0.0
    out: dict[str, Any] = {"assumes": "L3 fetch not overlapped; compute, L1/L2 as measured; TCP row is the measurement"}
    meas = [r["ttft_ms"] for r in rows]
    fab: dict[str, Any] = {"tcp_measured": _fabric_row(meas, nc)}
    for g in FABRICS_GBPS:
        t = [r["ttft_ms"] - r["l3_wait_ms"] + r["l3_bytes"] / (g * 1e9) * 1e3 for r in rows]
        fab[f"rdma_{g:g}GBps"] = _fabric_row(t, nc)
    out["fabrics"] = fab
    return out


def _fabric_row(t: Sequence[float], nc_median: float) -> dict[str, Any]:
    m = float(np.median(t)) if len(t) else 0.0
    return {"ttft_median_ms": round(m, 3), "ttft_p90_ms": round(float(np.percentile(t, 90)), 3) if len(t) else 0.0,
            "reduction_vs_no_cache": round(1 - m / nc_median, 4) if nc_median > 0 else None}  # fmt: skip

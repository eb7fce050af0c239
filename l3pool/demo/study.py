"""The demo's comparisons on the tiered cache: what per-layer overlap and prefetch-on-queue save,
the write policies at two L2 capacities, and the L2 capacity sweep.

They replay a shorter trace than the main one (the first `side_sessions` sessions, the
first `side_turns` turns; stated in the report as `side_trace`) because each row is a full replay of the L1+L2+L3
configuration: on this 2-core CPU the quick main trace's L1+L2+L3 replay takes ~6 s and the
report has 3 x repeats + 8 (+ sweep) of them. Every row is checked like the main replay
(bit-identical logits, per-page digests) and carries its own `logits_identical`/`wrong_pages`.
Each run writes to its own L3 namespace, removed from the pool afterwards.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from l3pool.cache import CacheConfig
from l3pool.demo.engine import DEMO_CACHE
from l3pool.demo.workload import Request

if TYPE_CHECKING:
    from l3pool.demo.replay import Demo, QueueRun

VARIANTS = ("on", "no_overlap", "no_prefetch")
# (row name, write policy of both boundaries, ghost list on)
POLICIES = (
    ("write_back", "write_back", True),
    ("write_through", "write_through", True),
    ("write_through_selective+ghost", "write_through_selective", True),
    ("write_through_selective", "write_through_selective", False),
)
PLATEAU = 0.01  # a capacity step that adds <= 1 point of local (L1+L2) hit rate is on the plateau


def side_trace(requests: list[Request], sessions: int, turns: int = 0) -> list[tuple[int, Request]]:
    """(index in the full trace, request) of the first `sessions` sessions (and their first
    `turns` turns; 0: all), in arrival order."""
    return [(i, r) for i, r in enumerate(requests) if r.session < sessions and (not turns or r.turn < turns)]


def spread_verdict(off: list[float], on: list[float]) -> dict[str, Any]:
    """Time saved by a feature (runs without it vs with it): the median difference and the range
    the runs allow. Verdict `inconclusive` when the two sets of runs overlap (or one run each),
    else `saved` / `costs`."""
    if not off or not on:
        raise ValueError("spread_verdict needs at least one run per side")
    saved = statistics.median(off) - statistics.median(on)
    lo, hi = min(off) - max(on), max(off) - min(on)
    if len(off) < 2 or len(on) < 2 or lo <= 0 <= hi:
        verdict = "inconclusive"
    else:
        verdict = "saved" if lo > 0 else "costs"
    return {"saved_s": round(saved, 4), "spread_s": [round(lo, 4), round(hi, 4)], "verdict": verdict}


def _run(demo: Demo, trace: list[tuple[int, Request]], tag: str, tick: str, **kw: Any) -> QueueRun:
    ns = demo.namespace(tag)
    try:
        return demo.run_queue(trace, "l1_l2_l3", ns, tick=tick, **kw)
    finally:
        demo.drop(ns)


def _checks(runs: list[QueueRun]) -> dict[str, Any]:
    return {
        "logits_identical": all(r.logits_identical for r in runs),
        "wrong_pages": sum(r.wrong_pages for r in runs),
    }


def savings(demo: Demo, trace: list[tuple[int, Request]], repeats: int) -> dict[str, Any]:
    """`repeats` rounds of the three variants (interleaved, so drifting machine load hits all):
    on, per-layer overlap off (wait for the whole load before compute), prefetch-on-queue off
    (load fetches L3 synchronously). Total prefill time of the side trace per run."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    runs: list[QueueRun] = []
    for k in range(repeats):
        for v in VARIANTS:
            r = _run(demo, trace, f"sv{k}-{v}", "savings", overlap=v != "no_overlap", prefetch=v != "no_prefetch")
            times[v].append(r.prefill_s)
            runs.append(r)
    ov = spread_verdict(times["no_overlap"], times["on"])
    pf = spread_verdict(times["no_prefetch"], times["on"])
    return {
        "runs": repeats,
        "prefill_s": {
            v: {"median": round(statistics.median(t), 4), "min": round(min(t), 4), "max": round(max(t), 4)}
            for v, t in times.items()
        },
        "overlap": ov,
        "prefetch": pf,
        **_checks(runs),
    }


def _row(run: QueueRun, page_size: int) -> dict[str, Any]:
    return {
        "hit_rate": run.hit_rate(page_size),
        "d2h_bytes": run.stats.get("d2h_bytes", 0),
        "l3_put_bytes": run.stats.get("l3_put_bytes", 0),
        "prefill_s": round(run.prefill_s, 4),
        "logits_identical": run.logits_identical,
        "wrong_pages": run.wrong_pages,
    }


def policies(demo: Demo, trace: list[tuple[int, Request]], capacities: list[int]) -> list[dict[str, Any]]:
    """One replay per write policy (the same on both boundaries) x L2 capacity."""
    rows = []
    P = demo.opts.model.page_size
    for cap in capacities:
        for name, pol, ghost in POLICIES:
            cfg = CacheConfig(
                l1_to_l2=pol,  # type: ignore[arg-type]
                l2_to_l3=pol,  # type: ignore[arg-type]
                ghost_capacity=DEMO_CACHE.ghost_capacity if ghost else 0,
                prefetch_policy=DEMO_CACHE.prefetch_policy,
            )
            run = _run(demo, trace, f"pol-{name}-{cap}", "policies", cache=cfg, l2_tokens=cap)
            rows.append({"policy": name, "l2_tokens": cap, **_row(run, P)})
    return rows


def sweep(demo: Demo, trace: list[tuple[int, Request]], start: int, points: int) -> dict[str, Any]:
    """L2 capacity doubling from `start` (the smallest the queue allows) until the local (L1+L2)
    hit rate gains <= 1 point; recommends the smallest capacity on the plateau (registered host
    memory past it costs without serving more hits). With L3 on, L3 serves what L2 misses, so the
    total hit rate is flat: the local rate is what L2 capacity buys."""
    P = demo.opts.model.page_size
    rows: list[dict[str, Any]] = []
    cap = start
    rec: int | None = None
    reason = f"no plateau within {points} capacities: the largest measured"
    for _ in range(points):
        run = _run(demo, trace, f"sweep-{cap}", "sweep", l2_tokens=cap)
        row = {"l2_tokens": cap, **_row(run, P)}
        row["local_hit_rate"] = round(row["hit_rate"]["L1"] + row["hit_rate"]["L2"], 4)
        rows.append(row)
        if len(rows) > 1 and row["local_hit_rate"] - rows[-2]["local_hit_rate"] <= PLATEAU:
            rec = rows[-2]["l2_tokens"]
            reason = (
                f"doubling {rec} -> {cap} tokens added {100 * (row['local_hit_rate'] - rows[-2]['local_hit_rate']):.1f}"
                f" points of L1+L2 hit rate (<= {100 * PLATEAU:.0f}): {rec} is the smallest on the plateau"
            )
            break
        cap *= 2
    if rec is None:
        rec = rows[-1]["l2_tokens"]
    return {"points": rows, "recommended_l2_tokens": rec, "reason": reason, **_checks_rows(rows)}


def _checks_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "logits_identical": all(r["logits_identical"] for r in rows),
        "wrong_pages": sum(r["wrong_pages"] for r in rows),
    }

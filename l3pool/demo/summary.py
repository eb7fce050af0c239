"""The demo report's numbers from the interleaved rounds (run.py): TTFT per configuration,
hit rate per tier, the miss-path self-check, bytes per tier and the what-if replay."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from l3pool.demo import timing
from l3pool.demo.engine import CONFIGS, TIERS, Record
from l3pool.demo.workload import Request, prefix_reuse

if TYPE_CHECKING:
    from l3pool.demo.replay import DemoOptions, QueueRun


def _rates(rs: list[Record], P: int, total: int) -> dict[str, float]:
    agg = dict.fromkeys(TIERS, 0)
    for r in rs:
        for k, v in r.tier_tokens(P).items():
            agg[k] += v
    return {k: round(v / total, 4) for k, v in agg.items()}


def summarize(
    opts: DemoOptions,
    requests: list[Request],
    runs: dict[str, list[QueueRun]],
    colds: dict[str, list[list[Record]]],
    page_bytes: int,
) -> dict[str, Any]:
    P = opts.model.page_size
    total = sum(r.length for r in requests)
    rounds = len(runs["no_cache"])
    ms = {c: [[r.total_s * 1e3 for r in run.recs] for run in runs[c]] for c in CONFIGS}
    ttft = {c: timing.ttft_stats(ms[c]) for c in CONFIGS}
    nc_med = ttft["no_cache"]["total_ms"]["median"]
    for c in CONFIGS[1:]:
        ttft[c]["reduction_vs_no_cache"] = round(1 - ttft[c]["total_ms"]["median"] / nc_med, 4) if nc_med else None
        per = [1 - a / b for a, b in zip(np.sum(ms[c], axis=1), np.sum(ms["no_cache"], axis=1), strict=True)]
        ttft[c]["reduction_spread"] = [round(float(min(per)), 4), round(float(max(per)), 4)]

    # the miss path: trace requests no configuration hit in any round, plus the cold prompts
    never = [i for i in range(len(requests)) if all(run.recs[i].hit_pages == 0 for c in CONFIGS for run in runs[c])]
    miss_s = {
        c: [sum(runs[c][k].recs[i].total_s for i in never) + sum(r.total_s for r in colds[c][k]) for k in range(rounds)]
        for c in CONFIGS
    }
    checks = {c: timing.miss_check(miss_s["no_cache"], miss_s[c]) for c in CONFIGS[1:]}
    biased = not all(x["equal_within_spread"] for x in checks.values())
    full = checks["l1_l2_l3"]
    overhead = {
        "overhead": full["overhead"], "spread": full["spread"], "headline": full["headline"],
        "by_config": checks,
        "requests": {"trace_never_hit": len(never), "cold": len(colds["no_cache"][0]) if colds["no_cache"] else 0},
        "definition": "1 - t_no_cache / t_cache over requests no configuration hit, per round (paired); median, range",
    }  # fmt: skip

    last = {c: runs[c][-1] for c in CONFIGS}
    fr, st = last["l1_l2_l3"].recs, last["l1_l2_l3"].stats
    tiers = {
        "L1_hit_bytes": sum(r.hit_l1 for r in fr) * page_bytes,
        "L3_to_L2": {"bytes": sum(r.l3_get_bytes for r in fr), "engine_wait_s": round(sum(r.l3_get_s for r in fr), 4)},
        "L2_to_L1": {"bytes": sum(r.load_bytes for r in fr), "engine_wait_s": round(sum(r.load_s for r in fr), 4)},
        "L1_to_L2_backup": {"bytes": st.get("d2h_bytes", 0)},
        "L2_to_L3_put": {"bytes": st.get("l3_put_bytes", 0)},
    }
    l3_share = [sum(r.hit_l3 for r in run.recs) * P / total for run in runs["l1_l2_l3"]]
    med3 = np.median(ms["l1_l2_l3"], axis=0)
    rows = [
        {"ttft_ms": float(med3[i]), "l3_bytes": float(r.l3_get_bytes), "l3_wait_ms": r.l3_get_s * 1e3}
        for i, r in enumerate(fr)
    ]
    nc_per = np.median(ms["no_cache"], axis=0)
    what_if = timing.what_if(rows, list(nc_per))
    prefill = {c: ttft[c]["total_ms"]["median"] / 1e3 for c in CONFIGS}
    per_request = [
        {
            "session": q.session, "turn": q.turn, "tokens": q.length,
            "instance": fr[i].instance.rsplit("-", 1)[-1],
            **{f"{c}_ms": round(float(np.median([m[i] for m in ms[c]])), 3) for c in CONFIGS},
            **{f"{c}_spread_ms": round(float(np.ptp([m[i] for m in ms[c]])) / 2, 3) for c in CONFIGS},
            "hit_pages": {t: getattr(fr[i], f"hit_{t.lower()}") for t in ("L1", "L2", "L3")},
        }
        for i, q in enumerate(requests)
    ]  # fmt: skip
    l1, l2 = opts.sizes()
    longest = max(r.length for r in requests)
    sizes = (
        f"L1 holds {l1} tokens per instance ({l1 / longest:.1f} x the longest request), L2 {l2} "
        f"({l2 / longest:.1f} x); {opts.instances} instances, "
    )
    if opts.placement == "affinity":
        why = sizes + (
            "requests routed by session (affinity), other sessions' requests between a session's turns: L1 serves "
            "the shared system prompt/tools and what the instance computed last, L2 a session's history that L1 "
            "evicted, L3 what L2 evicted too"
        )
    else:
        why = sizes + (
            "requests routed by session + turn, so a session's next turn lands on another instance: L1 serves the "
            "shared system prompt/tools and what the instance computed last, L2 what L1 evicted on the same "
            "instance, L3 the history other instances computed"
        )
    return {
        "ttft_ms": ttft,
        "hit_rate_why": why,
        "hit_rate": _rates(fr, P, total),
        "hit_rate_by_config": {c: _rates(last[c].recs, P, total) for c in CONFIGS[1:]},
        "l3_hit_share_by_round": [round(x, 4) for x in l3_share],
        "cache_overhead": overhead,
        "biased": biased,
        "what_if": what_if,
        "tiers": tiers,
        "prefill_s": {c: round(v, 4) for c, v in prefill.items()},
        "net_benefit_s": round(prefill["no_cache"] - prefill["l1_l2_l3"], 4),
        "l3_benefit_s": round(prefill["l1_l2"] - prefill["l1_l2_l3"], 4),
        "trace": {
            "sessions": opts.workload.sessions,
            "turns": opts.workload.turns,
            "requests": len(requests),
            "tokens": total,
            "min_context": min(r.length for r in requests),
            "max_context": max(r.length for r in requests),
            "prefix_reuse": round(prefix_reuse(requests, P), 4),
            "rounds": rounds,
        },
        "requests": per_request,
    }

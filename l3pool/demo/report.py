"""Text table and PNG plots of a demo report."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_NAMES = {"no_cache": "no cache", "l1_l2": "L1+L2", "l1_l2_l3": "L1+L2+L3"}


def interference_line(x: dict[str, Any]) -> str:
    """The interference row: both medians, then the slowdown of the paired tries with its range (the
    headline; the two medians come from different tries and may even disagree with it in sign, as on
    a loaded CPU), "within noise" when the range includes 0."""
    lo, hi = x["slowdown_spread"]
    noise = ": within noise" if lo <= 0 <= hi else ""
    return (f"interfere  forward {x['compute_alone_ms']['median']:.1f} ms alone, "
            f"{x['compute_with_l2_traffic_ms']['median']:.1f} ms with L2 traffic (medians); paired slowdown "
            f"{x['slowdown']:+.1%} (tries {lo:+.1%}..{hi:+.1%}{noise}), "
            f"{x['copy_GBps']['median']:.1f} GB/s copied"
            + _engine_part(x.get("engine"), "through the transfer engine")
            + _engine_part(x.get("engine_paced"), "paced to the trace's rate"))  # fmt: skip


def _engine_part(e: dict[str, Any] | None, what: str) -> str:
    """The cache's own copy path beside the plain copies, at full duty and paced to the trace's
    own rate (each absent in reports from before it was measured)."""
    if not e:
        return ""
    lo, hi = e["slowdown_spread"]
    noise = ": within noise" if lo <= 0 <= hi else ""
    gbps = f"{e['copy_GBps']['median']:.3g}"  # 3 digits: a paced CPU rate is ~0.02 GB/s
    return (f"; {what} {e['slowdown']:+.1%} (tries {lo:+.1%}..{hi:+.1%}{noise}), "
            f"{gbps} GB/s")  # fmt: skip


def _line(f: dict[str, Any], be: float | None) -> str:
    """One all-hit line of the fit: T(n) = a + b n and its break-even length."""
    a = f"{f['a_ms']:.2f} ms" + (" (intercept < 0: clamped)" if f["intercept_clamped"] else "")
    return f"T(n) = {a} + {f['b_us_per_token']:.3f} us/token; break-even " + (
        f"{be:.0f} tokens" if be is not None else "none"
    )


def table(rep: dict[str, Any]) -> str:
    tr, hr, fit, t, tt = rep["trace"], rep["hit_rate"], rep["fit"], rep["tiers"], rep["ttft_ms"]
    be = fit["break_even_tokens"]
    ov = rep["cache_overhead"]

    def gb(x: dict[str, Any]) -> str:
        w = x.get("engine_wait_s")
        return f"{x['bytes'] / 1e6:9.1f} MB" + (f" (engine waited {w * 1e3:7.1f} ms)" if w is not None else " " * 28)

    def rates(h: dict[str, float]) -> str:
        return " ".join(f"{k} {v:5.1%}" for k, v in h.items())

    def ttft(c: str) -> str:
        x = tt[c]
        red = f", total time {-x['reduction_vs_no_cache']:+.1%} vs no cache" if "reduction_vs_no_cache" in x else ""
        return f"{_NAMES[c]:<9} median {x['median']:9.1f} ms  p90 {x['p90']:9.1f} ms  (+-{x['spread']:.1f}){red}"

    lines = [
        f"model      {rep['model']} on {rep['device']}",
        f"workload   {tr['requests']} requests ({tr['sessions']} sessions x <= {tr['turns']} turns), "
        f"{tr['min_context']}-{tr['max_context']} tokens, prefix reuse {tr['prefix_reuse']:.2f}; {tr['rounds']} "
        "interleaved rounds",
        f"setup      {rep['setup']['instances']} prefill instances, {rep['setup'].get('pool', '')}",
        *("ttft       " + ttft(c) for c in _NAMES),
        "hit rate   " + rates(hr) + "   (L1+L2 only: " + rates(rep["hit_rate_by_config"]["l1_l2"]) + ")",
        f"overhead   miss path {ov['headline']} (rounds {ov['spread'][0]:+.1%}..{ov['spread'][1]:+.1%}); "
        f"biased: {rep['biased']}",
        f"fit        all-hit from L3 {_line(fit, be)}",
        *([f"           all-hit from L2 {_line(fit['l2'], fit['l2']['break_even_tokens'])}"] if "l2" in fit else []),
        f"           no cache {fit['no_cache_b_us_per_token']:.2f} us/token; medians of {fit.get('tries', '?')} tries",
        f"L3->L2     {gb(t['L3_to_L2'])}    L2->L1 {gb(t['L2_to_L1'])}",
        f"L1->L2     {gb(t['L1_to_L2_backup'])}    L2->L3 {gb(t['L2_to_L3_put'])}   (background threads)",
        "what-if    "
        + "  ".join(
            f"{k} {v['ttft_median_ms']:.0f} ms ({-v['reduction_vs_no_cache']:+.1%} vs no cache)"
            for k, v in rep["what_if"]["fabrics"].items()
            if v["reduction_vs_no_cache"] is not None
        ),
    ]
    if rep.get("interference"):
        x = rep["interference"]
        lines.append(interference_line(x))
    if rep.get("hf_reference"):
        for p in rep["hf_reference"]["points"]:
            hf = {
                k: f"{p[f'{k}_ms']['median']:.0f} ms" if p.get(f"{k}_ms") else "OOM"
                for k in ("hf_one_forward", "hf_chunked")
            }
            vs = p.get("vs_hf_one_forward") or {}
            lines.append(
                f"hf ref     {p['tokens']} tokens: engine no cache {p['engine_no_cache_ms']:.0f} ms "
                f"({p.get('engine_vs_hf_one_forward')}x HF one forward {hf['hf_one_forward']}; "
                f"{p['engine_vs_hf_chunked']}x HF chunked {hf['hf_chunked']})"
                + (f"; with the cache {vs['l1_l2_l3']}x one forward" if vs.get("l1_l2_l3") is not None else "")
            )
    if rep.get("savings"):
        sv, side = rep["savings"], rep["side_trace"]

        def saved(what: str) -> str:
            v, (lo, hi) = rep[f"{what}_saved_verdict"], rep[f"{what}_saved_spread_s"]
            head = "inconclusive" if v == "inconclusive" else f"{rep[f'{what}_saved_s']:+.3f} s ({v})"
            return f"{head}, runs allow {lo:+.3f}..{hi:+.3f} s"

        lines += [
            f"side trace {side['requests']} requests ({side['sessions']} sessions x {side['turns']} turns, "
            f"{side['tokens']} tokens) for the rows below; {sv['runs']} runs per variant",
            f"overlap    per-layer L2->L1 overlap saves {saved('overlap')}",
            f"prefetch   prefetch-on-queue saves {saved('prefetch')}",
            "policies   (both boundaries; hit rates of the side trace)",
        ]
        lines += [
            f"  {r['policy']:<30} L2 {r['l2_tokens']:>7}  {rates(r['hit_rate'])}  D2H {r['d2h_bytes'] / 1e6:7.1f} MB  "
            f"L3 put {r['l3_put_bytes'] / 1e6:7.1f} MB  prefill {r['prefill_s']:6.2f} s  "
            + ("ok" if r["logits_identical"] and not r["wrong_pages"] else "CHECKS FAILED")
            for r in rep["policies"]
        ]
    if rep.get("sweep"):
        sw = rep["sweep"]
        lines.append(f"L2 sweep   recommended {sw['recommended_l2_tokens']} tokens: {sw['reason']}")
        lines += [
            f"  L2 {q['l2_tokens']:>8}  {rates(q['hit_rate'])}  prefill {q['prefill_s']:6.2f} s" for q in sw["points"]
        ]
    fv = rep.get("logits_forward_variance") or 0
    lines.append(
        f"checks     logits identical: {rep['logits_identical']} ({rep['logits_compared']} compared"
        + (f"; {rep.get('logits_mismatched')} differ, {fv} of them where the forward pass varied on "
           "bit-identical cached KV" if not rep["logits_identical"] and rep.get("logits_mismatched") else "")
        + f"), wrong pages: {rep['wrong_pages']} of {rep['pages_verified']} verified"
    )  # fmt: skip
    return "\n".join(lines)


def _log_if_wide(ax: Any, vals: list[float], axis: str = "y") -> None:
    pos = [v for v in vals if v > 0]
    if pos and max(pos) / min(pos) >= 30:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def _label_bars(ax: Any, bars: Any, fmt: str) -> None:
    for b in bars:
        h = b.get_height()
        ax.annotate(fmt.format(h), (b.get_x() + b.get_width() / 2, h), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")  # fmt: skip


def plot(rep: dict[str, Any], out: Path) -> list[str]:
    """demo_ttft.png, demo_prefill.png, demo_tiers.png, demo_fit.png in `out`; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots")
        return []
    files = []
    title = f"{rep['model']} on {rep['device']}"
    tt = rep["ttft_ms"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [_NAMES[c] for c in _NAMES]
    med = [tt[c]["median"] for c in _NAMES]
    p90 = [tt[c]["p90"] for c in _NAMES]
    x = range(len(names))
    bars = ax.bar([i - 0.2 for i in x], med, width=0.4, yerr=[tt[c]["spread"] for c in _NAMES], capsize=3,
                  label="median (error bar: spread over rounds)")  # fmt: skip
    bars2 = ax.bar([i + 0.2 for i in x], p90, width=0.4, label="p90")
    _label_bars(ax, bars, "{:.0f}")
    _label_bars(ax, bars2, "{:.0f}")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("TTFT per request (ms)")
    ax.set_title(f"TTFT, {rep['trace']['rounds']} interleaved rounds" + (" (BIASED)" if rep["biased"] else ""))
    _log_if_wide(ax, med + p90)
    if ax.get_yscale() == "linear":
        ax.set_ylim(0, 1.15 * max(p90 + med))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8)
    fig.suptitle(title, fontsize=9)
    files.append(_save(fig, out / "demo_ttft.png"))

    reqs = rep["requests"]
    fig, ax = plt.subplots(figsize=(9, 4))
    allv = []
    for k, name in _NAMES.items():
        ys = [r[f"{k}_ms"] for r in reqs]
        allv += ys
        ax.plot(range(len(reqs)), ys, marker="o", ms=3, label=name)
    ax.set_xlabel("request (arrival order)")
    ax.set_ylabel("TTFT, median over rounds (ms)")
    ax.set_title("TTFT per request")
    _log_if_wide(ax, allv)
    ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=9)
    files.append(_save(fig, out / "demo_prefill.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    cfgs = {"L1+L2": rep["hit_rate_by_config"]["l1_l2"], "L1+L2+L3": rep["hit_rate"]}
    bottom = [0.0] * len(cfgs)
    for tier in ("L1", "L2", "L3", "miss"):
        vals = [c[tier] for c in cfgs.values()]
        bs = a1.bar(list(cfgs), vals, bottom=bottom, label=tier)
        for b, v, y0 in zip(bs, vals, bottom, strict=True):
            if v >= 0.03:
                a1.text(
                    b.get_x() + b.get_width() / 2, y0 + v / 2, f"{tier} {v:.0%}", ha="center", va="center", fontsize=8
                )
        bottom = [y + v for y, v in zip(bottom, vals, strict=True)]
    a1.set_ylabel("share of prompt tokens")
    a1.set_title("Where tokens came from")
    a1.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    t = rep["tiers"]
    names = ["L3->L2", "L2->L1", "L1->L2", "L2->L3"]
    vals = [t[k]["bytes"] / 1e6 for k in ("L3_to_L2", "L2_to_L1", "L1_to_L2_backup", "L2_to_L3_put")]
    _label_bars(a2, a2.bar(names, vals), "{:.0f}")
    a2.set_ylabel("MB moved (last round, L1+L2+L3)")
    a2.set_title("Bytes per tier move")
    _log_if_wide(a2, vals)
    fig.suptitle(title, fontsize=9)
    files.append(_save(fig, out / "demo_tiers.png"))

    fit = rep["fit"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p["tokens"] for p in fit["points"]]
    ax.scatter(xs, [p["all_hit_ms"] for p in fit["points"]], label="all hit (from L3), median")
    nc = [(r["tokens"], r["no_cache_ms"]) for r in reqs]
    nc += [(p["tokens"], p["no_cache_ms"]) for p in fit["points"] if "no_cache_ms" in p]
    ax.scatter([n for n, _ in nc], [m for _, m in nc], marker="x", label="no cache, median")
    x0, x1 = 0, max(xs + [n for n, _ in nc])
    if "l2" in fit:
        ax.scatter(xs, [p["l2_hit_ms"] for p in fit["points"]], marker="^", label="all hit (from L2), median")
    for f, tier in ((fit, "L3"), (fit.get("l2"), "L2")):
        if f is not None:
            a_lbl = f"from {tier}: T(n) = {f['a_ms']:.1f} ms + {f['b_us_per_token']:.2f} us/token"
            ax.plot([x0, x1], [f["a_ms"] + f["b_us_per_token"] * v / 1e3 for v in (x0, x1)], "--", label=a_lbl)
    ax.plot([x0, x1], [fit["no_cache_a_ms"] + fit["no_cache_b_us_per_token"] * v / 1e3 for v in (x0, x1)], ":",
            label="no-cache line")  # fmt: skip
    if (be := fit["break_even_tokens"]) is not None:
        ax.axvline(be, color="grey", lw=0.8, label=f"break-even (L3) {be:.0f}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("All-hit fit T(n) = a + b n")
    ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=9)
    files.append(_save(fig, out / "demo_fit.png"))
    return files


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
